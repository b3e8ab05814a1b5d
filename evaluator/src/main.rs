//! `ckpt-eval`: measure checkpointing. See `ckpt-eval --help`.
//!
//! With no subcommand it runs the default suite: every experiment at a small
//! size, tables on the terminal, and a run directory with `results.json`, CSVs,
//! plots, `report.md` and `report.html`.
//!
//! `ckpt-eval faults` runs fault campaigns instead (`ckpt-eval faults --help`).

use std::path::PathBuf;
use std::process::ExitCode;

use ckpt_eval::experiments::Ctx;
use ckpt_eval::models::{DtypeMix, MODELS};
use ckpt_eval::suite::{Experiment, SuiteConfig};
use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "ckpt-eval",
    version,
    about = "Measure checkpointing cost, formats, determinism, interference and intervals",
    after_help = "Fault campaigns: ckpt-eval faults --help"
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
    /// Model whose tensor shapes the state takes (resnet50, bert-large, gpt2-xl, llama3-8b).
    #[arg(long, global = true, default_value = "gpt2-xl")]
    model: String,
    /// State size in MiB: of the model-shaped state (parameters plus optimizer
    /// state; default 256), or of the `engine` subcommand's state (default 1024).
    #[arg(long, global = true)]
    mib: Option<usize>,
    /// Dtype mix: fp32, or bf16 (bf16 parameters, f32 master copy and moments).
    #[arg(long, global = true, default_value = "fp32")]
    dtype: String,
    /// Leave the Adam optimizer state out.
    #[arg(long, global = true)]
    no_optimizer: bool,
    /// Skip the Python baselines.
    #[arg(long, global = true)]
    no_python: bool,
    /// No progress bars.
    #[arg(long, global = true)]
    quiet: bool,
    /// State size of the engine benchmark in the suite, MiB.
    #[arg(long, global = true, default_value_t = 512)]
    engine_mib: usize,
    /// zstd levels of the native format (0 = uncompressed), comma separated.
    #[arg(long, global = true, value_delimiter = ',', default_values_t = vec![0, 1, 3])]
    zstd: Vec<i32>,
    /// Overhead: training steps per run.
    #[arg(long, global = true, default_value_t = 8)]
    steps: u64,
    /// Overhead: checkpoint every this many steps.
    #[arg(long, global = true, default_value_t = 4)]
    every: u64,
    /// Overhead: emulated compute per step, milliseconds.
    #[arg(long, global = true, default_value_t = 200)]
    compute_ms: u64,
    /// Interference: threads per noise generator.
    #[arg(long, global = true, default_value_t = 1)]
    intensity: usize,
    /// Interference: state size in MiB.
    #[arg(long, global = true, default_value_t = 64)]
    interference_mib: usize,
    /// Interval: mean time between failures, seconds.
    #[arg(long, global = true, default_value_t = 3600.0)]
    mtbf: f64,
    /// Interval: fixed restart cost (before loading), seconds.
    #[arg(long, global = true, default_value_t = 60.0)]
    restart: f64,
    /// Scale: rank counts to run under mpirun.
    #[arg(long, global = true, value_delimiter = ',', default_value = "1,2,4,8")]
    ranks: Vec<usize>,
    /// Scale: state size in MiB (every rank holds all of it).
    #[arg(long, global = true, default_value_t = 128)]
    scale_mib: usize,
    /// Sharded: rank counts to run under torchrun.
    #[arg(long, global = true, value_delimiter = ',', default_value = "2,4")]
    sharded_ranks: Vec<usize>,
    /// Sharded: MiB of f32 parameters of the FSDP2 model (AdamW adds twice that);
    /// a few hundred, so each rank's share is far above the engine's fixed costs.
    #[arg(long, global = true, default_value_t = 256.0)]
    sharded_mib: f64,
    /// Sharded: timed saves and loads per method (after a cold and a warm save, sampled for memory, not timed);
    /// three, so that one slow load (a first read into memory the machine just
    /// took back) does not decide the median.
    #[arg(long, global = true, default_value_t = 3)]
    sharded_repeats: usize,
    /// Python: transformer blocks of the GPT-2-shaped model (GPT-2's vocabulary).
    #[arg(long, global = true, default_value_t = 6)]
    python_layers: usize,
    /// Python: embedding width of the model (heads of 64).
    #[arg(long, global = true, default_value_t = 384)]
    python_width: usize,
    /// Python: tokens per sequence (also the context length).
    #[arg(long, global = true, default_value_t = 128)]
    python_seq: usize,
    /// Python: sequences per training step.
    #[arg(long, global = true, default_value_t = 1)]
    python_batch: usize,
    /// Python: timed saves and loads per method.
    #[arg(long, global = true, default_value_t = 2)]
    python_repeats: usize,
    /// Python: checkpoints per method in the training loop.
    #[arg(long, global = true, default_value_t = 3)]
    python_rounds: usize,
    /// Python: training steps between checkpoints in the training loop.
    #[arg(long, global = true, default_value_t = 4)]
    python_every: usize,
    /// S3: root URL (`s3://bucket/prefix`, credentials from the AWS_* variables);
    /// without it the S3 experiment is left out.
    #[arg(long, global = true, env = "CKPT_EVAL_S3_URL")]
    s3_url: Option<String>,
    #[command(subcommand)]
    cmd: Option<Cmd>,
}

#[derive(Subcommand, Clone, Copy)]
enum Cmd {
    /// The default suite (every experiment at a small size); also what runs with no subcommand.
    Suite,
    /// The engine benchmark: stall, time to commit, memory, incremental bytes.
    Engine {
        /// Number of tensors.
        #[arg(long, default_value_t = 64)]
        tensors: usize,
    },
    /// Formats: ckpt's formats and the Python baselines, save/load/size.
    Formats,
    /// Overhead of checkpointing a training loop every k steps.
    Overhead,
    /// Byte-identical saves and bitwise resume.
    Determinism,
    /// Checkpoints under memory/disk/CPU/network noise, and the reverse.
    Interference,
    /// Young/Daly interval and goodput from measured costs (runs formats and overhead).
    Interval,
    /// 1 to 8 ranks under mpirun, with and without dedup (needs the `mpi` feature).
    Scale,
    /// FSDP2 state on 2 and 4 ranks (torchrun): ckpt beside dcp and torch-checkpointing.
    Sharded,
    /// A GPT-2-shaped PyTorch model and AdamW from Python: ckpt beside torch.save,
    /// safetensors, dcp and torch-checkpointing, and real training loops.
    Python,
    /// Save and load on S3 beside a plain multipart upload and ranged download (needs --s3-url).
    S3,
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
    let mix = DtypeMix::parse(&cli.dtype)
        .ok_or_else(|| format!("--dtype must be fp32 or bf16, not {:?}", cli.dtype))?;
    if !MODELS.contains(&cli.model.as_str()) {
        return Err(format!("--model must be one of {MODELS:?}").into());
    }
    let (experiments, engine_mib, engine_tensors) = match cli.cmd {
        None | Some(Cmd::Suite) => (Experiment::ALL.to_vec(), cli.engine_mib, 64),
        Some(Cmd::Engine { tensors }) => {
            (vec![Experiment::Engine], cli.mib.unwrap_or(1024), tensors)
        }
        Some(Cmd::Formats) => (vec![Experiment::Formats], 0, 0),
        Some(Cmd::Overhead) => (vec![Experiment::Overhead], 0, 0),
        Some(Cmd::Determinism) => (vec![Experiment::Determinism], 0, 0),
        Some(Cmd::Interference) => (vec![Experiment::Interference], 0, 0),
        Some(Cmd::Scale) => (vec![Experiment::Scale], 0, 0),
        Some(Cmd::Sharded) => (vec![Experiment::Sharded], 0, 0),
        Some(Cmd::Python) => (vec![Experiment::Python], 0, 0),
        Some(Cmd::S3) => (vec![Experiment::S3], 0, 0),
        Some(Cmd::Interval) => (
            vec![
                Experiment::Formats,
                Experiment::Overhead,
                Experiment::Interval,
            ],
            0,
            0,
        ),
    };
    let dir = run_dir(&cli.out)?;
    std::fs::create_dir_all(&cli.scratch)?;
    let ctx = Ctx {
        scratch: std::fs::canonicalize(&cli.scratch)?,
        repeats: cli.repeats.max(1),
        python: if cli.no_python {
            None
        } else {
            ckpt_eval::python::interpreter()
        },
        progress: !cli.quiet,
    };
    let cfg = SuiteConfig {
        experiments,
        model: cli.model.clone(),
        mib: cli.mib.unwrap_or(256),
        mix,
        optimizer: !cli.no_optimizer,
        engine_mib,
        engine_tensors,
        zstd_levels: cli.zstd.clone(),
        steps: cli.steps,
        every: cli.every.max(1),
        compute_ms: cli.compute_ms,
        noise_intensity: cli.intensity,
        interference_mib: cli.interference_mib,
        mtbf_s: cli.mtbf,
        restart_s: cli.restart,
        scale_ranks: cli.ranks.clone(),
        scale_mib: cli.scale_mib,
        sharded_ranks: cli.sharded_ranks.clone(),
        sharded_mib: cli.sharded_mib,
        sharded_repeats: cli.sharded_repeats.max(1),
        python_layers: cli.python_layers.max(1),
        python_width: cli.python_width.max(64),
        python_seq: cli.python_seq.max(2),
        python_batch: cli.python_batch.max(1),
        python_repeats: cli.python_repeats.max(1),
        python_rounds: cli.python_rounds.max(1),
        python_every: cli.python_every.max(1),
        s3_url: cli.s3_url.clone(),
    };
    let started = std::time::Instant::now();
    let results = ckpt_eval::suite::run(&ctx, &cfg).await?;
    for t in ckpt_eval::report::tables(&results) {
        print!("{}", t.to_text());
    }
    for (what, why) in &results.not_included {
        println!("\nnot included: {what} ({why})");
    }
    if let Some(e) = results
        .formats
        .as_ref()
        .and_then(|f| f.python_error.as_ref())
    {
        println!("\nPython baselines missing: {e}");
    }
    let took: Vec<String> = results
        .timings
        .iter()
        .map(|(n, t)| format!("{n} {t:.0} s"))
        .collect();
    println!("\ntime per experiment: {}", took.join(", "));
    ckpt_eval::report::write_all(&results, &dir)?;
    println!(
        "\nreport: {} and {} ({:.0} s)",
        dir.join("report.html").display(),
        dir.join("report.md").display(),
        started.elapsed().as_secs_f64()
    );
    Ok(results.errors.is_empty())
}

fn main() -> ExitCode {
    // `ckpt-eval faults ...`: the fault campaigns, with their own options.
    if std::env::args().nth(1).as_deref() == Some("faults") {
        return ckpt_eval::faults::main(std::env::args().skip(1));
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
