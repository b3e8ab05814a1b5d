//! `ckpt-eval`: measure checkpointing. See `ckpt-eval --help`.

use std::path::PathBuf;
use std::process::ExitCode;

use ckpt_eval::experiments::engine::{EngineBench, EngineResults};
use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "ckpt-eval",
    version,
    about = "Measure checkpointing cost, formats, scale and recovery"
)]
struct Cli {
    /// Directory on the disk under test (checkpoints are written and deleted here).
    #[arg(long, global = true, default_value = "runs/scratch")]
    scratch: PathBuf,
    /// Where results go (a new run directory is made inside).
    #[arg(long, global = true, default_value = "runs")]
    out: PathBuf,
    /// Repeats of each measurement.
    #[arg(long, global = true, default_value_t = 3)]
    repeats: usize,
    #[command(subcommand)]
    cmd: Option<Cmd>,
}

#[derive(Subcommand)]
enum Cmd {
    /// The default suite (every experiment at a small size).
    Suite,
    /// The engine benchmark: stall, time to commit, memory, incremental bytes.
    Engine {
        /// State size in MiB.
        #[arg(long, default_value_t = 1024)]
        mib: usize,
        /// Number of tensors.
        #[arg(long, default_value_t = 64)]
        tensors: usize,
    },
}

fn print_engine(r: &EngineResults) {
    let mib = r.state_bytes as f64 / (1 << 20) as f64;
    println!(
        "\nEngine: {mib:.0} MiB of F32 in {} tensors (median of {} runs, [min, max])",
        r.tensors, r.memcpy_s.n
    );
    let row = |name: &str, s: &ckpt_eval::stats::Summary| {
        println!(
            "  {name:<38} {:>9.4} s  [{:.4}, {:.4}]",
            s.median, s.min, s.max
        );
    };
    row("memcpy of the state (1 thread)", &r.memcpy_s);
    row("raw write + fsync", &r.raw_write_fsync_s);
    row("eager save stall, cold pool", &r.eager_stall_cold_s);
    row("eager save stall, warm pool", &r.eager_stall_s);
    row("lazy save stall", &r.lazy_stall_s);
    row("lazy snapshot (background)", &r.lazy_snapshot_s);
    row("save until committed, warm pool", &r.commit_s);
    row("save until committed, cold pool", &r.commit_cold_s);
    println!(
        "  {:<38} {:>9.1} MiB",
        "peak extra memory (cold save)",
        r.peak_extra_bytes.median / (1 << 20) as f64
    );
    println!(
        "  {:<38} {:>9.1} MiB of {:.1} MiB",
        "stored by a 10%-changed checkpoint",
        r.incremental_stored_bytes as f64 / (1 << 20) as f64,
        r.first_stored_bytes as f64 / (1 << 20) as f64
    );
    println!("\n  {:<40} {:>8} {:>8}  met", "target", "ratio", "bound");
    for t in &r.targets {
        println!(
            "  {:<40} {:>8.3} {:>8.2}  {}",
            t.what,
            t.ratio,
            t.bound,
            if t.met { "yes" } else { "NO" }
        );
    }
}

fn run_dir(out: &std::path::Path) -> std::io::Result<PathBuf> {
    let stamp = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default()
        .as_secs();
    let dir = out.join(format!("run-{stamp}"));
    std::fs::create_dir_all(&dir)?;
    Ok(dir)
}

async fn run(cli: Cli) -> Result<(), Box<dyn std::error::Error>> {
    let dir = run_dir(&cli.out)?;
    std::fs::create_dir_all(&cli.scratch)?;
    let scratch = std::fs::canonicalize(&cli.scratch)?;
    let (mib, tensors) = match cli.cmd {
        Some(Cmd::Engine { mib, tensors }) => (mib, tensors),
        Some(Cmd::Suite) | None => (1024, 64),
    };
    let bench = EngineBench {
        bytes: mib << 20,
        tensors,
        repeats: cli.repeats.max(1),
    };
    let r = bench.run(&scratch).await?;
    print_engine(&r);
    let json = serde_json::json!({ "engine": r });
    std::fs::write(dir.join("results.json"), serde_json::to_vec_pretty(&json)?)?;
    println!("\nresults: {}", dir.join("results.json").display());
    Ok(())
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("tokio runtime");
    match rt.block_on(run(cli)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}
