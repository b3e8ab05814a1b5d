//! The suite: which experiments to run, on what state, and their results
//! gathered in one place (what `results.json` holds).

use std::time::{Duration, Instant};

use serde::Serialize;

use crate::experiments::determinism::{DeterminismBench, DeterminismResults};
use crate::experiments::engine::{EngineBench, EngineResults};
use crate::experiments::formats::{FormatResults, FormatsBench};
use crate::experiments::interference::{InterferenceBench, InterferenceResults};
use crate::experiments::interval::{IntervalBench, IntervalResults};
use crate::experiments::overhead::{OverheadBench, OverheadResults};
use crate::experiments::pytrain::{PyTrainBench, PyTrainResults};
use crate::experiments::s3::{S3Bench, S3Results};
use crate::experiments::scale::{ScaleBench, ScaleResults};
use crate::experiments::sharded::{ShardedBench, ShardedResults};
use crate::experiments::{BoxError, Ctx};
use crate::limits::Limits;
use crate::models::{DtypeMix, ModelState};

/// The experiments.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum Experiment {
    /// The engine benchmark (its own state and floors).
    Engine,
    /// Formats and the Python baselines.
    Formats,
    /// Training-loop overhead.
    Overhead,
    /// Determinism and bitwise resume.
    Determinism,
    /// Interference both ways.
    Interference,
    /// Young/Daly interval and goodput (needs formats and overhead).
    Interval,
    /// 1 to 8 ranks under mpirun.
    Scale,
    /// FSDP2 state on 2 and 4 ranks under torchrun: ckpt beside DCP and torch-checkpointing.
    Sharded,
    /// A GPT-2-shaped PyTorch model and AdamW through ckpt's Python API beside
    /// torch.save, safetensors, DCP and torch-checkpointing; real training loops.
    Python,
    /// Save and load on an S3 server beside plain multipart and ranged transfers.
    S3,
}

impl Experiment {
    /// Every experiment of the default suite, in order.
    pub const ALL: [Experiment; 10] = [
        Experiment::Engine,
        Experiment::Formats,
        Experiment::Overhead,
        Experiment::Determinism,
        Experiment::Interference,
        Experiment::Interval,
        Experiment::Scale,
        Experiment::Sharded,
        Experiment::Python,
        Experiment::S3,
    ];
}

/// Settings of a suite run.
#[derive(Debug, Clone, Serialize)]
pub struct SuiteConfig {
    /// Which experiments.
    pub experiments: Vec<Experiment>,
    /// Model whose shapes the state takes.
    pub model: String,
    /// State size in MiB (parameters and optimizer state).
    pub mib: usize,
    /// Dtype mix.
    pub mix: DtypeMix,
    /// Include Adam state.
    pub optimizer: bool,
    /// State size of the engine benchmark, MiB.
    pub engine_mib: usize,
    /// Tensors of the engine benchmark's state.
    pub engine_tensors: usize,
    /// zstd levels of the native format in the formats experiment (0 = none).
    pub zstd_levels: Vec<i32>,
    /// Steps per overhead run.
    pub steps: u64,
    /// Checkpoint every this many steps.
    pub every: u64,
    /// Emulated compute per step, milliseconds.
    pub compute_ms: u64,
    /// Threads per noise generator.
    pub noise_intensity: usize,
    /// State size of the interference experiment, MiB (saves under disk noise are slow).
    pub interference_mib: usize,
    /// MTBF for the interval experiment, seconds.
    pub mtbf_s: f64,
    /// Fixed restart cost, seconds.
    pub restart_s: f64,
    /// Rank counts of the scale experiment.
    pub scale_ranks: Vec<usize>,
    /// State size of the scale experiment, MiB (every rank holds all of it).
    pub scale_mib: usize,
    /// Rank counts of the sharded experiment.
    pub sharded_ranks: Vec<usize>,
    /// MiB of parameters of the sharded experiment's model (AdamW adds twice that).
    pub sharded_mib: f64,
    /// Timed saves and loads per method in the sharded experiment.
    pub sharded_repeats: usize,
    /// Python experiment: transformer blocks of the GPT-2-shaped model.
    pub python_layers: usize,
    /// Python experiment: embedding width.
    pub python_width: usize,
    /// Python experiment: tokens per sequence (and context length).
    pub python_seq: usize,
    /// Python experiment: sequences per training step.
    pub python_batch: usize,
    /// Python experiment: timed saves and loads per method.
    pub python_repeats: usize,
    /// Python experiment: checkpoints per method in the training loop.
    pub python_rounds: usize,
    /// Python experiment: training steps between checkpoints in the loop.
    pub python_every: usize,
    /// Root URL of the S3 experiment (`s3://bucket/prefix`); none: not run.
    pub s3_url: Option<String>,
}

/// Everything a suite run measured.
#[derive(Debug, Clone, Serialize, Default)]
pub struct SuiteResults {
    /// The settings.
    pub config: Option<SuiteConfig>,
    /// Raw bytes and tensor count of the generated state.
    pub state_bytes: u64,
    /// Tensors of the generated state.
    pub state_tensors: usize,
    /// The machine's floors for the state.
    pub limits: Option<Limits>,
    /// Engine benchmark.
    pub engine: Option<EngineResults>,
    /// Formats.
    pub formats: Option<FormatResults>,
    /// Overhead.
    pub overhead: Option<OverheadResults>,
    /// Determinism.
    pub determinism: Option<DeterminismResults>,
    /// Interference.
    pub interference: Option<InterferenceResults>,
    /// Interval.
    pub interval: Option<IntervalResults>,
    /// Scale.
    pub scale: Option<ScaleResults>,
    /// Sharded (FSDP2) state.
    pub sharded: Option<ShardedResults>,
    /// A PyTorch model and its training loop, from Python.
    pub python: Option<PyTrainResults>,
    /// S3 against its own baseline.
    pub s3: Option<S3Results>,
    /// Experiments that failed, with the error.
    pub errors: Vec<(String, String)>,
    /// Experiments of the issue that are not in this suite, and why.
    pub not_included: Vec<(String, String)>,
    /// Seconds per experiment.
    pub timings: Vec<(String, f64)>,
}

fn record<T>(r: &mut SuiteResults, name: &str, t: Instant, out: Result<T, BoxError>) -> Option<T> {
    r.timings.push((name.to_owned(), t.elapsed().as_secs_f64()));
    match out {
        Ok(v) => Some(v),
        Err(e) => {
            eprintln!("{name} failed: {e}");
            r.errors.push((name.to_owned(), e.to_string()));
            None
        }
    }
}

/// Run the configured experiments.
pub async fn run(ctx: &Ctx, cfg: &SuiteConfig) -> Result<SuiteResults, BoxError> {
    let mut r = SuiteResults {
        config: Some(cfg.clone()),
        not_included: vec![
            (
                "faults".into(),
                "its own command, `ckpt-eval faults` (it drives a tch job built with the `faults` feature)".into(),
            ),
        ],
        ..Default::default()
    };
    let has = |e: Experiment| cfg.experiments.contains(&e);
    if has(Experiment::Engine) {
        let t = Instant::now();
        eprintln!(
            "engine: {} MiB in {} tensors",
            cfg.engine_mib, cfg.engine_tensors
        );
        let bench = EngineBench {
            bytes: cfg.engine_mib << 20,
            tensors: cfg.engine_tensors,
            repeats: ctx.repeats,
        };
        let out = bench.run(&ctx.scratch).await.map_err(BoxError::from);
        r.engine = record(&mut r, "engine", t, out);
    }
    if has(Experiment::Scale) {
        let t = Instant::now();
        eprintln!(
            "scale: {} MiB on {:?} ranks",
            cfg.scale_mib, cfg.scale_ranks
        );
        let bench = ScaleBench {
            ranks: cfg.scale_ranks.clone(),
            mib: cfg.scale_mib,
            tensors: 32,
        };
        let out = bench.run(ctx);
        r.scale = record(&mut r, "scale", t, out);
    }
    if has(Experiment::Sharded) {
        // `unavailable` gives the reason, also when there is no interpreter at all.
        match (
            &ctx.python,
            crate::experiments::sharded::unavailable(ctx.python.as_deref()),
        ) {
            (Some(py), None) => {
                let t = Instant::now();
                eprintln!(
                    "sharded: FSDP2 model of {} MiB of parameters plus AdamW on {:?} ranks",
                    cfg.sharded_mib, cfg.sharded_ranks
                );
                let bench = ShardedBench {
                    ranks: cfg.sharded_ranks.clone(),
                    mib: cfg.sharded_mib,
                    repeats: cfg.sharded_repeats,
                    timeout: Duration::from_secs(600),
                };
                let out = bench.run(ctx, py);
                r.sharded = record(&mut r, "sharded", t, out);
            }
            (_, why) => {
                let why = why.unwrap_or_default();
                eprintln!("sharded: skipped: {why}");
                r.not_included.push(("sharded".into(), why));
            }
        }
    }
    if has(Experiment::Python) {
        match (
            &ctx.python,
            crate::experiments::pytrain::unavailable(ctx.python.as_deref()),
        ) {
            (Some(py), None) => {
                let t = Instant::now();
                eprintln!(
                    "python: GPT-2-shaped model, {} layers of width {}, plus AdamW",
                    cfg.python_layers, cfg.python_width
                );
                let bench = PyTrainBench {
                    layers: cfg.python_layers,
                    width: cfg.python_width,
                    seq: cfg.python_seq,
                    batch: cfg.python_batch,
                    repeats: cfg.python_repeats,
                    rounds: cfg.python_rounds,
                    every: cfg.python_every,
                    timeout: Duration::from_secs(600),
                };
                let out = bench.run(ctx, py);
                r.python = record(&mut r, "python", t, out);
            }
            (_, why) => {
                let why = why.unwrap_or_default();
                eprintln!("python: skipped: {why}");
                r.not_included.push(("python".into(), why));
            }
        }
    }
    let needs_state = cfg.experiments.iter().any(|e| {
        !matches!(
            e,
            Experiment::Engine | Experiment::Scale | Experiment::Sharded | Experiment::Python
        )
    });
    if !needs_state {
        return Ok(r);
    }
    let state = ModelState {
        model: cfg.model.clone(),
        bytes: cfg.mib << 20,
        mix: cfg.mix,
        optimizer: cfg.optimizer,
        seed: 1,
    }
    .build()?;
    r.state_bytes = state.nbytes();
    r.state_tensors = state.tensors.len();
    eprintln!(
        "state: {} shapes, {:?}, optimizer {}: {:.1} MiB in {} tensors",
        cfg.model,
        cfg.mix,
        cfg.optimizer,
        r.state_bytes as f64 / (1 << 20) as f64,
        r.state_tensors
    );
    let t = Instant::now();
    let lim = Limits::measure(&state, &ctx.scratch, ctx.repeats)?;
    r.timings.push(("limits".into(), t.elapsed().as_secs_f64()));
    r.limits = Some(lim.clone());

    if has(Experiment::Formats) || has(Experiment::Interval) {
        let t = Instant::now();
        let out = FormatsBench {
            zstd_levels: cfg.zstd_levels.clone(),
        }
        .run(ctx, &state, &lim)
        .await;
        r.formats = record(&mut r, "formats", t, out);
    }
    if has(Experiment::Overhead) || has(Experiment::Interval) {
        let t = Instant::now();
        let bench = OverheadBench {
            steps: cfg.steps,
            every: cfg.every,
            compute: Duration::from_millis(cfg.compute_ms),
        };
        let out = bench.run(ctx, &state).await;
        r.overhead = record(&mut r, "overhead", t, out);
    }
    if has(Experiment::Determinism) {
        let t = Instant::now();
        let out = DeterminismBench {
            steps: 200,
            stop_at: 77,
        }
        .run(ctx, &state)
        .await;
        r.determinism = record(&mut r, "determinism", t, out);
    }
    if has(Experiment::Interference) {
        let t = Instant::now();
        let bench = InterferenceBench {
            intensity: cfg.noise_intensity,
            steps: 12,
            every: 4,
            kernel_iters: 12_000_000,
        };
        let small = ModelState {
            model: cfg.model.clone(),
            bytes: cfg.interference_mib << 20,
            mix: cfg.mix,
            optimizer: cfg.optimizer,
            seed: 2,
        }
        .build()?;
        let out = bench.run(ctx, &small).await;
        r.interference = record(&mut r, "interference", t, out);
    }
    if has(Experiment::S3) {
        match crate::experiments::s3::unavailable(cfg.s3_url.as_deref()) {
            None => {
                let t = Instant::now();
                let bench = S3Bench {
                    url: cfg.s3_url.clone().unwrap_or_default(),
                    repeats: ctx.repeats,
                };
                let out = bench.run(&state).await;
                r.s3 = record(&mut r, "s3", t, out);
            }
            Some(why) => {
                eprintln!("s3: skipped: {why}");
                r.not_included.push(("s3".into(), why));
            }
        }
    }
    if has(Experiment::Interval) {
        if let Some(o) = &r.overhead {
            let bench = IntervalBench {
                mtbf_s: cfg.mtbf_s,
                restart_fixed_s: cfg.restart_s,
            };
            r.interval = Some(bench.run(o, r.formats.as_ref()));
        } else {
            r.errors.push((
                "interval".into(),
                "needs the overhead results, which failed".into(),
            ));
        }
    }
    Ok(r)
}
