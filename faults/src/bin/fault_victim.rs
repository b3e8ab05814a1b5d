//! The training job that `ckpt-faults` kills, corrupts and restarts.
//!
//! The training loop of the `tch_train` example (`ckpt_examples::tch_loop`: a tch
//! MLP trained with ckpt's `Adam` on generated data, one intra-op thread, torch
//! reseeded from `(seed, step)` at the top of every step, lazy snapshots, resume
//! from `load_latest`), with hooks for what a fault campaign needs:
//!
//! - a frozen input projection (a fine-tuning job's pretrained layer) before a
//!   narrower MLP: saved in every checkpoint with the same bytes, so every
//!   checkpoint shares its chunk and one damaged chunk damages them all;
//! - `--store-faults SEED:RATE` wraps the store in `FaultStore` (errors, timeouts,
//!   partial writes, lost acks on puts; errors on gets and lists) under a
//!   `RetryStore`; `SEED:full` makes every write fail, as a full disk does;
//! - a failed save is reported and training goes on (a checkpoint that could not be
//!   written must not stop the job);
//! - `--report FILE` appends one JSON line per event, fsynced, each an
//!   `ckpt_faults::event::Event`: `start` (resumed from, skipped
//!   checkpoints with their errors, load time), `first_step`, `save` (with the
//!   faults injected so far), `done`, `error`;
//! - `--torch-baseline save|restore --torch-file FILE` leaves ckpt out and goes
//!   through libtorch's own serializer instead (`torch_baseline`): `save` trains
//!   to `--steps` and writes the same state with `Tensor::save_multi` (event
//!   `torch_save`), `restore` reads it in a fresh process, takes one step and
//!   stops (events `torch_load`, `first_step`); `--root` is not used.
//!
//! ```text
//! fault_victim --root DIR --out WEIGHTS --report FILE [--steps 40] [--every 4]
//!              [--seed 1] [--keep 3] [--eager] [--device cpu|cuda]
//!              [--store-faults SEED:RATE|SEED:full]
//!              [--torch-baseline save|restore --torch-file FILE]
//! ```
//!
//! Stdout: the loop's lines (`fresh start` / `resumed from step N`,
//! `step N loss L`, `checkpoint N started`, `checkpoint N committed`,
//! `checkpoint N failed: ...`, `done N`).

#[path = "fault_victim/torch_baseline.rs"]
mod torch_baseline;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::{Parser, ValueEnum};

use ckpt_core::store::{FaultCounts, FaultPlan, FaultStore, RetryOptions, RetryStore};
use ckpt_core::torch::rng;
use ckpt_core::torch::tch::{self, nn, Device, Kind, Tensor};
use ckpt_core::{CheckpointId, Checkpointer, CheckpointerBuilder, Error, Loaded, Result};
use ckpt_examples::tch_loop::{self, mlp, parse_device, Hooks, TrainConfig, INPUTS};
use ckpt_faults::event::{Event, Failure};
use ckpt_faults::record::Skipped;

/// Width of the victim's hidden layers.
const HIDDEN: i64 = 96;

/// The victim's command line (see the module docs).
#[derive(Parser, Debug)]
#[command(
    name = "fault_victim",
    about = "The training job a fault campaign kills"
)]
struct Args {
    /// Checkpoint root directory.
    #[arg(long)]
    root: PathBuf,
    /// Where to write the final weights.
    #[arg(long)]
    out: PathBuf,
    /// Append the report events to this file.
    #[arg(long)]
    report: Option<PathBuf>,
    /// Train until this many steps are done.
    #[arg(long, default_value_t = 40)]
    steps: u64,
    /// Checkpoint every this many steps (0 is taken as 1).
    #[arg(long, default_value_t = 4)]
    every: u64,
    /// The run's seed.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Checkpoints to keep.
    #[arg(long, default_value_t = 3)]
    keep: usize,
    /// Eager snapshots (the default is lazy).
    #[arg(long)]
    eager: bool,
    /// `cpu` or `cuda`.
    #[arg(long, default_value = "cpu", value_parser = parse_device)]
    device: Device,
    /// `SEED:RATE` (flaky store) or `SEED:full` (every write fails).
    #[arg(long, value_parser = parse_store_faults)]
    store_faults: Option<(u64, Option<f64>)>,
    /// Save or restore through libtorch's serializer instead of ckpt (the baseline).
    #[arg(long, value_enum, requires = "torch_file")]
    torch_baseline: Option<Baseline>,
    /// The file of `--torch-baseline`.
    #[arg(long, requires = "torch_baseline")]
    torch_file: Option<PathBuf>,
}

/// What `--torch-baseline` does.
#[derive(Debug, Clone, Copy, ValueEnum)]
enum Baseline {
    /// Train to `--steps` and write the state.
    Save,
    /// Read the state, take one step, stop.
    Restore,
}

fn parse_store_faults(v: &str) -> std::result::Result<(u64, Option<f64>), String> {
    let (s, r) = v
        .split_once(':')
        .ok_or("--store-faults SEED:RATE or SEED:full")?;
    let seed = s.parse::<u64>().map_err(|e| format!("{v}: {e}"))?;
    let rate = match r {
        "full" => None,
        r => Some(r.parse::<f64>().map_err(|e| format!("{v}: {e}"))?),
    };
    Ok((seed, rate))
}

fn error_kind(e: &Error) -> &'static str {
    match e {
        Error::Corrupt { .. } => "corrupt",
        Error::NotFound { .. } => "not_found",
        Error::Unsupported(_) => "unsupported",
        Error::Storage(_) if e.is_damage() => "not_found",
        Error::Storage(_) => "storage",
        Error::Conflict(_) => "conflict",
        Error::Io(_) => "io",
        Error::Timeout(_) | Error::Stragglers { .. } => "timeout",
        _ => "other",
    }
}

fn failure(e: &Error) -> Failure {
    Failure {
        kind: error_kind(e).to_owned(),
        error: e.to_string(),
    }
}

fn skipped(id: &CheckpointId, e: &Error) -> Skipped {
    let f = failure(e);
    Skipped {
        step: id.step,
        attempt: id.attempt.clone(),
        kind: f.kind,
        error: f.error,
    }
}

/// What the victim adds to the training loop.
struct Victim {
    root: PathBuf,
    store_faults: Option<(u64, Option<f64>)>,
    /// The fault-injecting store, once the checkpointer is built on it.
    faults: Option<FaultStore>,
    /// The report file (`None`: no report).
    report: Option<std::fs::File>,
    /// When the process started.
    t0: Instant,
    first_step: bool,
}

impl Victim {
    fn report(&mut self, e: Event) {
        if let Some(f) = &mut self.report {
            let _ = e.append(f);
        }
    }

    fn counts(&self) -> FaultCounts {
        self.faults
            .as_ref()
            .map(FaultStore::injected)
            .unwrap_or_default()
    }
}

impl Hooks for Victim {
    fn model(&mut self, vs: &nn::VarStore, cfg: &TrainConfig) -> Result<nn::SequentialT> {
        // The frozen projection: drawn from the seed alone, never trained, restored
        // from the checkpoint like every other variable.
        rng::reseed(cfg.seed, u64::MAX - 1);
        let init = Tensor::randn([INPUTS, INPUTS], (Kind::Float, Device::Cpu)) * 0.5;
        let proj = vs
            .root()
            .sub("frozen")
            .zeros_no_train("proj", &[INPUTS, INPUTS]);
        tch::no_grad(|| {
            let mut p = proj.shallow_clone();
            p.copy_(&init.to_device(cfg.device));
        });
        Ok(nn::seq_t()
            .add_fn(move |x| x.matmul(&proj))
            .add(mlp(&vs.root().sub("net"), HIDDEN)))
    }

    fn checkpointer(&mut self, cfg: &TrainConfig) -> Result<CheckpointerBuilder> {
        let base = ckpt_core::store::open_dir(&self.root)?;
        self.faults = self.store_faults.map(|(seed, rate)| {
            let plan = match rate {
                Some(p) => FaultPlan {
                    get_error: p / 4.0,
                    list_error: p / 8.0,
                    timeout: Duration::from_millis(40),
                    ..FaultPlan::flaky_puts(seed, p)
                },
                None => FaultPlan {
                    put_error: 1.0,
                    ..FaultPlan::none(seed)
                },
            };
            FaultStore::new(base.clone(), plan)
        });
        // 4 KiB chunks: the 4 KiB frozen projection is a chunk of its own (shared by
        // every checkpoint, as a pretrained layer would be), the small tensors are packed.
        let mut opts = ckpt_core::CheckpointerOptions::default();
        opts.write.chunk_size = 4 << 10;
        let builder = ckpt_formats::builder(cfg.root.clone()).options(opts);
        Ok(match (&self.faults, self.store_faults) {
            (Some(f), Some((_, Some(_)))) => builder.store(Arc::new(RetryStore::new(
                Arc::new(f.clone()),
                RetryOptions {
                    max_retries: 4,
                    init_backoff: Duration::from_millis(2),
                    max_backoff: Duration::from_millis(50),
                    attempt_timeout: Some(Duration::from_secs(5)),
                },
            ))),
            // A full disk: retrying does not make room.
            (Some(f), _) => builder.store(Arc::new(f.clone())),
            (None, _) => builder.store(base),
        })
    }

    async fn loaded(
        &mut self,
        cp: &Checkpointer,
        loaded: Option<&Loaded>,
        load_ms: f64,
    ) -> Result<()> {
        let since_exec_ms = self.t0.elapsed().as_secs_f64() * 1e3;
        let (resumed_from, attempt, skipped) = match loaded {
            Some(l) => (
                Some(l.id.step),
                Some(l.id.attempt.clone()),
                l.skipped.iter().map(|(id, e)| skipped(id, e)).collect(),
            ),
            None => {
                // `load_latest` does not return what it skipped when nothing loads:
                // ask each committed checkpoint, newest first, as it did.
                let mut damaged = Vec::new();
                for id in cp.committed().await?.into_iter().rev() {
                    match cp.load(&id).await {
                        Err(e) if e.is_damage() => damaged.push(skipped(&id, &e)),
                        Err(e) => return Err(e),
                        Ok(_) => {
                            return Err(Error::Internal(format!(
                                "load_latest found nothing, but {id} loads"
                            )))
                        }
                    }
                }
                (None, None, damaged)
            }
        };
        self.report(Event::Start {
            pid: std::process::id(),
            load_ms,
            since_exec_ms,
            resumed_from,
            attempt,
            skipped,
        });
        Ok(())
    }

    fn stepped(&mut self, step: u64) {
        if self.first_step {
            self.first_step = false;
            self.report(Event::FirstStep {
                step,
                since_exec_ms: self.t0.elapsed().as_secs_f64() * 1e3,
                faults: self.counts(),
            });
        }
    }

    fn snapshot_failed(&mut self, step: u64, e: Error) -> Result<()> {
        // The save is lost; its error comes to `save_ended`.
        eprintln!("snapshot of step {step} failed: {e}");
        Ok(())
    }

    fn save_ended(&mut self, step: u64, result: Result<()>) -> Result<()> {
        // A checkpoint that could not be written does not stop the job.
        let faults = self.counts();
        self.report(Event::Save {
            step,
            failed: result.err().as_ref().map(failure),
            faults,
        });
        Ok(())
    }

    fn done(&mut self, step: u64) {
        let faults = self.counts();
        self.report(Event::Done { step, faults });
    }
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let t0 = Instant::now();
    let a = Args::parse();
    let cfg = TrainConfig {
        root: format!("file://{}", a.root.display()),
        steps: a.steps,
        every: a.every.max(1),
        seed: a.seed,
        device: a.device,
        lazy: !a.eager,
        keep: a.keep,
        out: Some(a.out.clone()),
    };
    let mut victim = Victim {
        root: a.root,
        store_faults: a.store_faults,
        faults: None,
        report: a.report.as_ref().and_then(|p| {
            std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(p)
                .ok()
        }),
        t0,
        first_step: true,
    };
    let ran = match (a.torch_baseline, &a.torch_file) {
        (Some(Baseline::Save), Some(f)) => torch_baseline::save(&cfg, &mut victim, f),
        (Some(Baseline::Restore), Some(f)) => torch_baseline::restore(&cfg, &mut victim, f),
        _ => tch_loop::train_with(&cfg, &mut victim).await.map(drop),
    };
    if let Err(e) = ran {
        victim.report(Event::Error(failure(&e)));
        eprintln!("fault_victim: {e}");
        std::process::exit(1);
    }
}
