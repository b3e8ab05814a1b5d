//! `ckpt`: inspect and maintain checkpoints under a URL.
//!
//! ```text
//! ckpt list URL [--verify]     every checkpoint with step, size, tensors, status
//! ckpt verify URL [--step N]   read and check every tensor of one checkpoint (default: newest)
//! ckpt gc URL --keep-last N    apply retention and delete garbage
//! ckpt convert SRC DST --format F   copy a checkpoint (or a .pt/.safetensors file) into format F
//! ```

use std::process::ExitCode;

use ckpt_core::{Retention, Status};
use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "ckpt",
    version,
    about = "Inspect and maintain ckpt checkpoints"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// List the checkpoints under URL.
    List {
        /// Root URL (file:///dir, memory://name, or a path).
        url: String,
        /// Also read and verify every tensor of each committed checkpoint.
        #[arg(long)]
        verify: bool,
    },
    /// Verify one checkpoint (the newest committed one by default).
    Verify {
        /// Root URL.
        url: String,
        /// Step to verify.
        #[arg(long)]
        step: Option<u64>,
    },
    /// Apply retention and delete what no kept checkpoint needs.
    Gc {
        /// Root URL.
        url: String,
        /// Keep the newest N checkpoints.
        #[arg(long)]
        keep_last: usize,
        /// Also keep every checkpoint whose step is a multiple of K.
        #[arg(long)]
        keep_every: Option<u64>,
    },
    /// Copy a checkpoint (or a plain .pt/.safetensors file) into another format.
    Convert {
        /// Source: a root URL (newest intact checkpoint) or a .pt/.pth/.bin/.safetensors file.
        src: String,
        /// Destination: a root URL, or a .pt/.safetensors file (never overwritten).
        dst: String,
        /// Format of a destination root (native, safetensors, torch, ...).
        #[arg(long, default_value = "native")]
        format: String,
        /// Step to convert (default: the newest).
        #[arg(long)]
        step: Option<u64>,
    },
}

fn human(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = bytes as f64;
    let mut u = 0;
    while v >= 1024.0 && u < UNITS.len() - 1 {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{bytes} B")
    } else {
        format!("{v:.1} {}", UNITS[u])
    }
}

async fn run(cli: Cli) -> ckpt_core::Result<bool> {
    match cli.cmd {
        Cmd::List { url, verify } => {
            let cp = ckpt_formats::builder(&url).build().await?;
            let rows = cp.list(verify).await?;
            println!(
                "{:>12}  {:<16}  {:>10}  {:>7}  {:<11}  status",
                "step", "attempt", "size", "tensors", "format"
            );
            let mut ok = true;
            for r in &rows {
                let status = match &r.status {
                    Status::Committed => "committed".to_owned(),
                    Status::Incomplete => "incomplete".to_owned(),
                    Status::Corrupt(why) => {
                        ok = false;
                        format!("CORRUPT: {why}")
                    }
                    other => format!("{other:?}"),
                };
                println!(
                    "{:>12}  {:<16}  {:>10}  {:>7}  {:<11}  {status}",
                    r.id.step,
                    r.id.attempt,
                    human(r.bytes),
                    r.tensors,
                    r.format.as_deref().unwrap_or("-")
                );
            }
            if rows.is_empty() {
                println!("(no checkpoints)");
            }
            Ok(ok)
        }
        Cmd::Verify { url, step } => {
            let cp = ckpt_formats::builder(&url).build().await?;
            let ids = cp.committed().await?;
            let id = match step {
                Some(s) => ids.into_iter().rev().find(|i| i.step == s),
                None => ids.into_iter().next_back(),
            }
            .ok_or_else(|| ckpt_core::Error::NotFound {
                what: format!("a committed checkpoint under {url}"),
            })?;
            let t = std::time::Instant::now();
            let m = cp.verify(&id).await?;
            println!(
                "{id}: {} tensors, {} verified in {:.2}s",
                m.tensors.len(),
                human(m.raw_bytes()),
                t.elapsed().as_secs_f64()
            );
            Ok(true)
        }
        Cmd::Gc {
            url,
            keep_last,
            keep_every,
        } => {
            let cp = ckpt_formats::builder(&url)
                .retention(Retention {
                    keep_last: Some(keep_last),
                    keep_every,
                })
                .build()
                .await?;
            let r = cp.gc().await?;
            println!(
                "retired {} checkpoints, removed {} incomplete saves, deleted {} chunks{}",
                r.retired.len(),
                r.incomplete_removed.len(),
                r.chunks_deleted,
                if r.chunk_sweep_skipped {
                    " (chunk sweep skipped: a kept manifest is unreadable)"
                } else {
                    ""
                }
            );
            Ok(true)
        }
        Cmd::Convert {
            src,
            dst,
            format,
            step,
        } => {
            let opts = ckpt_formats::convert::ConvertOptions { format, step };
            let r = ckpt_formats::convert::convert(&src, &dst, &opts).await?;
            println!(
                "step {}: {} tensors, {} written to {dst} as {}",
                r.step,
                r.tensors,
                human(r.bytes),
                r.format
            );
            Ok(true)
        }
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let rt = tokio::runtime::Runtime::new().expect("tokio runtime");
    match rt.block_on(run(cli)) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::from(1),
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::from(2)
        }
    }
}
