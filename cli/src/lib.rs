//! `ckpt`: inspect, maintain and export checkpoints under a URL (`file://`, a
//! path, `memory://`, `s3://`, `tiered+...`).
//!
//! ```text
//! ckpt list URL [--verify] [--json]   every checkpoint: step, size, tensors, format, status
//! ckpt verify URL [--step N]          read and check every tensor of one checkpoint
//! ckpt gc URL --keep-last N [--grace-secs S]  apply retention and delete garbage
//! ckpt discard-after URL STEP         roll a stopped job back: discard the later checkpoints
//! ckpt convert SRC DST --format F     copy a checkpoint (or a .pt/.safetensors file) into format F
//! ckpt export URL OUT --entry model [--format safetensors|pt] [--dtype bf16] [--hf]
//! ```
//!
//! The same code runs as the `ckpt` binary of this crate and as the `ckpt`
//! console script of the Python package ([`main_with_args`]).

use std::ffi::OsString;
use std::path::PathBuf;

use ckpt_core::{Retention, Status};
use clap::{Parser, Subcommand};

mod list;

#[derive(Parser)]
#[command(
    name = "ckpt",
    version,
    about = "Inspect, maintain and export ckpt checkpoints"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// List the checkpoints under URL.
    List {
        /// Root URL (file:///dir, a path, s3://bucket/prefix, tiered+..., memory://name).
        url: String,
        /// Also read and verify every tensor of each committed checkpoint.
        #[arg(long)]
        verify: bool,
        /// One JSON array instead of the table (for scripts).
        #[arg(long)]
        json: bool,
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
        /// Keep unreferenced chunks and incomplete saves younger than this many
        /// seconds: a job still running may be writing them. The command never
        /// claims a writer epoch, so it does not fence a running job.
        #[arg(long, default_value_t = 600)]
        grace_secs: u64,
    },
    /// Roll a stopped job back to the checkpoint of STEP: discard every
    /// committed checkpoint of a later step, so that the restarted job
    /// resumes from STEP's. Stop the job first: this claims the root's next
    /// writer epoch, which fences an incarnation still running.
    DiscardAfter {
        /// Root URL.
        url: String,
        /// The step to go back to (a committed checkpoint).
        step: u64,
        /// Keep chunks and incomplete saves younger than this many seconds
        /// when collecting what the discarded checkpoints referenced.
        #[arg(long, default_value_t = 600)]
        grace_secs: u64,
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
    /// Write the tensors of one entry (e.g. the model) for inference: unsharded,
    /// named by their state-dict keys, without ckpt's internal state.
    Export {
        /// Root URL.
        url: String,
        /// Output file (.safetensors, .pt), or directory with --hf. Never overwritten.
        out: PathBuf,
        /// The entry of the saved state to export (`model` of `save(step, model=...)`).
        #[arg(long)]
        entry: String,
        /// File format: safetensors or pt.
        #[arg(long, default_value = "safetensors")]
        format: String,
        /// Cast floating-point tensors to bf16, f16 or f32.
        #[arg(long)]
        dtype: Option<String>,
        /// Hugging Face's layout in directory OUT: model.safetensors, or shards of at
        /// most --max-shard-size bytes with model.safetensors.index.json.
        #[arg(long)]
        hf: bool,
        /// Largest file of an --hf export, in bytes.
        #[arg(long, default_value_t = ckpt_formats::export::HF_SHARD_BYTES)]
        max_shard_size: u64,
        /// A config.json to copy into an --hf export.
        #[arg(long)]
        config: Option<PathBuf>,
        /// Step to export (default: the newest).
        #[arg(long)]
        step: Option<u64>,
    },
}

/// `1.5 GiB`.
pub fn human(bytes: u64) -> String {
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
        Cmd::List { url, verify, json } => {
            let cp = ckpt_formats::builder(&url).read_only().build().await?;
            let rows = cp.list(verify).await?;
            let ok = !rows.iter().any(|r| matches!(r.status, Status::Corrupt(_)));
            if json {
                println!("{}", list::json(&rows, verify));
            } else {
                print!("{}", list::table(&rows, verify));
            }
            Ok(ok)
        }
        Cmd::Verify { url, step } => {
            let cp = ckpt_formats::builder(&url).read_only().build().await?;
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
            grace_secs,
        } => {
            let opts = ckpt_core::CheckpointerOptions {
                retention: Retention {
                    keep_last: Some(keep_last),
                    keep_every,
                },
                // An operator's collection beside a running job: unfenced, with
                // a grace period, and it judges zombies by the root's claims.
                fencing: false,
                gc_grace: std::time::Duration::from_secs(grace_secs),
                ..Default::default()
            };
            let cp = ckpt_formats::builder(&url).options(opts).build().await?;
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
        Cmd::DiscardAfter {
            url,
            step,
            grace_secs,
        } => {
            let opts = ckpt_core::CheckpointerOptions {
                gc_grace: std::time::Duration::from_secs(grace_secs),
                ..Default::default()
            };
            let cp = ckpt_formats::builder(&url).options(opts).build().await?;
            let r = cp.discard_after(step).await?;
            let steps: Vec<String> = r
                .retired
                .iter()
                .filter(|id| id.step > step)
                .map(|id| id.step.to_string())
                .collect();
            println!(
                "discarded {} checkpoints after step {step}{}; deleted {} chunks",
                steps.len(),
                if steps.is_empty() {
                    String::new()
                } else {
                    format!(" ({})", steps.join(", "))
                },
                r.chunks_deleted
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
        Cmd::Export {
            url,
            out,
            entry,
            format,
            dtype,
            hf,
            max_shard_size,
            config,
            step,
        } => {
            use ckpt_formats::export;
            let opts = export::ExportOptions {
                entry,
                format: format.parse()?,
                dtype: dtype
                    .as_deref()
                    .map(export::cast::parse_target)
                    .transpose()?,
                hf,
                step,
                max_shard_bytes: max_shard_size,
                config,
            };
            let r = export::export(&url, &out, &opts).await?;
            println!(
                "step {}: {} tensors of `{}`, {} written to {}",
                r.step,
                r.tensors,
                opts.entry,
                human(r.bytes),
                out.display()
            );
            for f in &r.files {
                println!("  {}", f.display());
            }
            Ok(true)
        }
    }
}

/// Run the `ckpt` command with `args` (the first is the program name); returns
/// the exit status: 0 success, 1 a check found damage, 2 an error.
pub fn main_with_args<I, T>(args: I) -> i32
where
    I: IntoIterator<Item = T>,
    T: Into<OsString> + Clone,
{
    let cli = match Cli::try_parse_from(args) {
        Ok(cli) => cli,
        Err(e) => {
            let _ = e.print();
            return e.exit_code();
        }
    };
    let rt = match tokio::runtime::Runtime::new() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: cannot start the I/O runtime: {e}");
            return 2;
        }
    };
    match rt.block_on(run(cli)) {
        Ok(true) => 0,
        Ok(false) => 1,
        Err(e) => {
            eprintln!("error: {e}");
            2
        }
    }
}
