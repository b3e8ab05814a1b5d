//! `ckpt-eval`: measure checkpointing. See `ckpt-eval --help`.
//!
//! With no subcommand it runs the default suite: every experiment at a size
//! that takes a few minutes on 2 cores (`--full` for the heavy one), tables on
//! the terminal, and a run directory with `results.json`, CSVs, plots,
//! `report.md` and `report.html`.
//!
//! The fault campaigns are a test harness of their own: `ckpt-faults` (the
//! `faults/` crate).

use std::path::PathBuf;
use std::process::ExitCode;

use ckpt_eval::suite::{Cmd, Common, SuiteArgs};
use clap::Parser;

#[derive(Parser)]
#[command(
    name = "ckpt-eval",
    version,
    about = "Measure checkpointing cost, formats, determinism, interference and intervals",
    after_help = "Fault campaigns: ckpt-faults --help (the faults/ crate)"
)]
struct Cli {
    #[command(flatten)]
    common: Common,
    #[command(flatten)]
    suite: SuiteArgs,
    #[command(subcommand)]
    cmd: Option<Cmd>,
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

async fn run(cli: Cli) -> Result<bool, Box<dyn std::error::Error + Send + Sync>> {
    let ctx = cli.common.ctx()?;
    let experiments = match &cli.cmd {
        None => cli.suite.experiments(),
        Some(cmd) => cmd.experiments(&cli.suite),
    };
    let dir = run_dir(&cli.common.out)?;
    let started = std::time::Instant::now();
    let results = ckpt_eval::suite::run(&ctx, &experiments).await;
    print!("{}", ckpt_eval::report::to_text(&results));
    ckpt_eval::report::write_all(&results, &dir)?;
    println!(
        "\nreport: {} and {} ({:.0} s)",
        dir.join("report.html").display(),
        dir.join("report.md").display(),
        started.elapsed().as_secs_f64()
    );
    let ok = results.errors().next().is_none();
    Ok(ok)
}

fn main() -> ExitCode {
    if std::env::args().nth(1).as_deref() == Some("faults") {
        eprintln!(
            "the fault campaigns are their own command: source scripts/env.sh && \
             cargo build --release -p ckpt-faults --features victim && ./target/release/ckpt-faults --help\n\
             (restart times by source, memory tier to torch.load: ckpt-eval memtier; \
             restarts of the tch job after SIGKILLs: ckpt-eval recovery)"
        );
        return ExitCode::FAILURE;
    }
    let cli = Cli::parse();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("tokio runtime");
    match rt.block_on(run(cli)) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => {
            eprintln!("some experiments failed (see the report)");
            ExitCode::FAILURE
        }
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}
