//! The training job that `ckpt-eval faults` kills, corrupts and restarts.
//!
//! A tch MLP trained with ckpt's `Adam` on generated data, the same construction as
//! the `tch_train` example (one intra-op thread, torch reseeded from `(seed, step)`
//! at the top of every step, lazy snapshots, resume from `load_latest`), plus what
//! a fault campaign needs and that example has no hook for:
//!
//! - a frozen input projection (a fine-tuning job's pretrained layer): saved in
//!   every checkpoint with the same bytes, so every checkpoint shares its chunk and
//!   one damaged chunk damages them all;
//! - `--store-faults SEED:RATE` wraps the store in `FaultStore` (errors, timeouts,
//!   partial writes, lost acks on puts; errors on gets and lists) under a
//!   `RetryStore`; `SEED:full` makes every write fail, as a full disk does;
//! - a failed save is reported and training goes on (a checkpoint that could not be
//!   written must not stop the job);
//! - `--report FILE` appends one JSON line per event, fsynced, each an
//!   `ckpt_eval::faults::event::Event`: `start` (resumed from, skipped
//!   checkpoints with their errors, load time), `first_step`, `save` (with the
//!   faults injected so far), `done`, `error`.
//!
//! ```text
//! fault_victim --root DIR --out WEIGHTS --report FILE [--steps 40] [--every 4]
//!              [--seed 1] [--keep 3] [--eager] [--device cpu|cuda]
//!              [--store-faults SEED:RATE|SEED:full]
//! ```
//!
//! Stdout, one line per event: `fresh start` / `resumed from step N`, `step N`,
//! `checkpoint N started`, `checkpoint N committed`, `checkpoint N failed: ...`,
//! `done N`.

use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Parser;

use ckpt_core::store::{FaultCounts, FaultPlan, FaultStore, RetryOptions, RetryStore};
use ckpt_core::torch::tch::nn::{self, ModuleT};
use ckpt_core::torch::tch::{self, Device, Kind, Tensor};
use ckpt_core::torch::{restore, rng, Adam, AdamConfig, TorchCapture};
use ckpt_core::{CheckpointId, Error, Result, Retention, SaveHandle, SnapshotMode, Value};
use ckpt_eval::faults::event::{Event, Failure};
use ckpt_eval::faults::report::Skipped;

const INPUTS: i64 = 32;
const HIDDEN: i64 = 96;
const OUTPUTS: i64 = 8;
const BATCH: i64 = 64;

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
}

fn parse_device(v: &str) -> std::result::Result<Device, String> {
    match v {
        "cpu" => Ok(Device::Cpu),
        "cuda" => Ok(Device::Cuda(0)),
        o => Err(format!("unknown device {o} (cpu or cuda)")),
    }
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

/// Appends the events to the report file, if there is one.
struct Report(Option<std::fs::File>);

impl Report {
    fn event(&mut self, e: Event) {
        if let Some(f) = &mut self.0 {
            let _ = e.append(f);
        }
    }
}

fn counts(f: Option<&FaultStore>) -> FaultCounts {
    f.map(FaultStore::injected).unwrap_or_default()
}

fn failure(e: &Error) -> Failure {
    Failure {
        kind: error_kind(e).to_owned(),
        error: e.to_string(),
    }
}

fn skipped(id: &CheckpointId, e: &Error) -> Skipped {
    Skipped {
        step: id.step,
        attempt: id.attempt.clone(),
        kind: error_kind(e).to_owned(),
        error: e.to_string(),
    }
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
        Error::Timeout(_) => "timeout",
        _ => "other",
    }
}

fn model(p: &nn::Path) -> impl ModuleT {
    nn::seq_t()
        .add(nn::linear(p / "l1", INPUTS, HIDDEN, Default::default()))
        .add_fn(|x| x.relu())
        .add_fn_t(|x, train| x.dropout(0.1, train))
        .add(nn::linear(p / "l2", HIDDEN, HIDDEN, Default::default()))
        .add_fn(|x| x.relu())
        .add(nn::linear(p / "l3", HIDDEN, OUTPUTS, Default::default()))
}

/// Final weights: every variable in name order, `name nbytes\n` then its bytes.
fn dump(vs: &nn::VarStore) -> Vec<u8> {
    let mut vars: Vec<(String, Tensor)> = vs.variables().into_iter().collect();
    vars.sort_by(|a, b| a.0.cmp(&b.0));
    let mut out = Vec::new();
    for (name, t) in vars {
        let t = t.to_device(Device::Cpu).contiguous();
        let mut bytes = vec![0u8; t.numel() * t.kind().elt_size_in_bytes()];
        t.copy_data_u8(&mut bytes, t.numel());
        out.extend_from_slice(format!("{name} {}\n", bytes.len()).as_bytes());
        out.extend_from_slice(&bytes);
    }
    out
}

/// Wait for a save; its report event.
async fn finish(h: SaveHandle, faults: Option<&FaultStore>) -> Event {
    let step = h.id().step;
    let failed = match h.wait().await {
        Ok(_) => {
            println!("checkpoint {step} committed");
            None
        }
        Err(e) => {
            println!("checkpoint {step} failed: {e}");
            Some(failure(&e))
        }
    };
    Event::Save {
        step,
        failed,
        faults: counts(faults),
    }
}

async fn train(a: &Args, report: &mut Report, t0: Instant) -> Result<u64> {
    tch::set_num_threads(1);
    tch::manual_seed(a.seed as i64);
    let mut vs = nn::VarStore::new(a.device);
    // The frozen projection: drawn from the seed alone, never trained, restored
    // from the checkpoint like every other variable.
    rng::reseed(a.seed, u64::MAX - 1);
    let proj_init = Tensor::randn([INPUTS, INPUTS], (Kind::Float, Device::Cpu)) * 0.5;
    let proj = vs
        .root()
        .sub("frozen")
        .zeros_no_train("proj", &[INPUTS, INPUTS]);
    tch::no_grad(|| {
        let mut p = proj.shallow_clone();
        p.copy_(&proj_init.to_device(a.device));
    });
    let net = model(&vs.root().sub("net"));
    let mut opt = Adam::new(
        &vs,
        AdamConfig {
            lr: 3e-3,
            weight_decay: 1e-5,
            ..Default::default()
        },
    )?;
    rng::reseed(a.seed, u64::MAX);
    let teacher = Tensor::randn([INPUTS, OUTPUTS], (Kind::Float, Device::Cpu)).to_device(a.device);

    let base = ckpt_core::store::open_dir(&a.root)?;
    let faults = a.store_faults.map(|(seed, rate)| {
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
    let builder = ckpt_formats::builder(format!("file://{}", a.root.display()))
        .options(opts)
        .retention(Retention::keep_last(a.keep));
    let mut builder = match (&faults, a.store_faults) {
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
    };
    if !a.eager {
        builder = builder.snapshot(SnapshotMode::Lazy);
    }
    let cp = builder.build().await?;

    let mut step = 0u64;
    let t_load = Instant::now();
    let loaded = cp.load_latest().await?;
    let load_ms = t_load.elapsed().as_secs_f64() * 1e3;
    let since_exec_ms = t0.elapsed().as_secs_f64() * 1e3;
    let (resumed_from, attempt, skipped) = match loaded {
        Some(l) => {
            let meta = &l.state.meta;
            if meta.get("seed").and_then(Value::as_int) != Some(a.seed as i64) {
                return Err(Error::InvalidInput("checkpoint of another seed".into()));
            }
            step = meta
                .get("step")
                .and_then(Value::as_int)
                .and_then(|s| u64::try_from(s).ok())
                .ok_or_else(|| Error::InvalidInput("checkpoint without a step".into()))?;
            restore::var_store(&mut vs, &l.state, "model/")?;
            opt.restore("optim/", &l.state)?;
            println!("resumed from step {step}");
            (
                Some(step),
                Some(l.id.attempt.clone()),
                l.skipped.iter().map(|(id, e)| skipped(id, e)).collect(),
            )
        }
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
            println!("fresh start");
            (None, None, damaged)
        }
    };
    report.event(Event::Start {
        pid: std::process::id(),
        load_ms,
        since_exec_ms,
        resumed_from,
        attempt,
        skipped,
    });

    let mut pending: Option<SaveHandle> = None;
    let mut first = true;
    while step < a.steps {
        rng::reseed(a.seed, step);
        let x = Tensor::randn([BATCH, INPUTS], (Kind::Float, a.device));
        let y = x.matmul(&teacher).tanh();
        let h = x.matmul(&proj);
        let loss = net.forward_t(&h, true).mse_loss(&y, tch::Reduction::Mean);
        opt.zero_grad();
        loss.backward();
        if let Some(h) = &pending {
            if let Err(e) = h.wait_snapshot().await {
                // The save is lost; its error comes out of `wait` below.
                eprintln!("snapshot of step {} failed: {e}", h.id().step);
            }
        }
        opt.step()?;
        step += 1;
        println!("step {step}");
        if first {
            first = false;
            report.event(Event::FirstStep {
                step,
                since_exec_ms: t0.elapsed().as_secs_f64() * 1e3,
                faults: counts(faults.as_ref()),
            });
        }
        if step % a.every == 0 {
            if let Some(h) = pending.take() {
                report.event(finish(h, faults.as_ref()).await);
            }
            let mut cap = TorchCapture::new();
            cap.var_store("model/", &vs)?;
            opt.capture("optim/", &mut cap)?;
            cap.meta("step", Value::Int(step as i64));
            cap.meta("seed", Value::Int(a.seed as i64));
            match cp.save(step, cap).await {
                Ok(h) => {
                    println!("checkpoint {step} started");
                    pending = Some(h);
                }
                Err(e) => {
                    println!("checkpoint {step} failed: {e}");
                    report.event(Event::Save {
                        step,
                        failed: Some(failure(&e)),
                        faults: counts(faults.as_ref()),
                    });
                }
            }
        }
    }
    if let Some(h) = pending.take() {
        report.event(finish(h, faults.as_ref()).await);
    }
    let tmp = a.out.with_extension("tmp");
    {
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(&dump(&vs))?;
        f.sync_all()?;
    }
    std::fs::rename(&tmp, &a.out)?;
    report.event(Event::Done {
        step,
        faults: counts(faults.as_ref()),
    });
    println!("done {step}");
    Ok(step)
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let t0 = Instant::now();
    let mut a = Args::parse();
    a.every = a.every.max(1);
    let mut report = Report(a.report.as_ref().and_then(|p| {
        std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(p)
            .ok()
    }));
    if let Err(e) = train(&a, &mut report, t0).await {
        report.event(Event::Error(failure(&e)));
        eprintln!("fault_victim: {e}");
        std::process::exit(1);
    }
}
