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
//! - `--report FILE` appends one JSON line per event, fsynced: `start` (resumed
//!   from, skipped checkpoints with their errors, load time), `first_step`, `save`
//!   (with the faults injected so far), `done`.
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

use ckpt_core::store::{FaultPlan, FaultStore, RetryOptions, RetryStore};
use ckpt_core::torch::tch::nn::{self, ModuleT};
use ckpt_core::torch::tch::{self, Device, Kind, Tensor};
use ckpt_core::torch::{restore, rng, Adam, AdamConfig, TorchCapture};
use ckpt_core::{Error, Result, Retention, SaveHandle, SnapshotMode, Value};

const INPUTS: i64 = 32;
const HIDDEN: i64 = 96;
const OUTPUTS: i64 = 8;
const BATCH: i64 = 64;

struct Args {
    root: PathBuf,
    out: PathBuf,
    report: PathBuf,
    steps: u64,
    every: u64,
    seed: u64,
    keep: usize,
    lazy: bool,
    device: Device,
    store_faults: Option<(u64, Option<f64>)>,
}

fn parse() -> std::result::Result<Args, String> {
    let mut a = Args {
        root: PathBuf::new(),
        out: PathBuf::new(),
        report: PathBuf::new(),
        steps: 40,
        every: 4,
        seed: 1,
        keep: 3,
        lazy: true,
        device: Device::Cpu,
        store_faults: None,
    };
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        if flag == "--eager" {
            a.lazy = false;
            continue;
        }
        let v = args.next().ok_or_else(|| format!("{flag} needs a value"))?;
        let num = |v: &str| v.parse::<u64>().map_err(|e| format!("{flag} {v}: {e}"));
        match flag.as_str() {
            "--root" => a.root = v.into(),
            "--out" => a.out = v.into(),
            "--report" => a.report = v.into(),
            "--steps" => a.steps = num(&v)?,
            "--every" => a.every = num(&v)?.max(1),
            "--seed" => a.seed = num(&v)?,
            "--keep" => a.keep = num(&v)? as usize,
            "--device" => {
                a.device = match v.as_str() {
                    "cpu" => Device::Cpu,
                    "cuda" => Device::Cuda(0),
                    o => return Err(format!("unknown device {o}")),
                }
            }
            "--store-faults" => {
                let (s, r) = v
                    .split_once(':')
                    .ok_or("--store-faults SEED:RATE or SEED:full")?;
                let rate = match r {
                    "full" => None,
                    r => Some(r.parse::<f64>().map_err(|e| format!("{v}: {e}"))?),
                };
                a.store_faults = Some((num(s)?, rate));
            }
            o => return Err(format!("unknown flag {o}")),
        }
    }
    if a.root.as_os_str().is_empty() || a.out.as_os_str().is_empty() {
        return Err("--root and --out are required".into());
    }
    Ok(a)
}

/// Appends fsynced JSON lines to the report file.
struct Report(Option<std::fs::File>);

impl Report {
    fn line(&mut self, v: serde_json::Value) {
        if let Some(f) = &mut self.0 {
            let _ = writeln!(f, "{v}");
            let _ = f.sync_data();
        }
    }
}

fn counts(f: Option<&FaultStore>) -> serde_json::Value {
    let c = f.map(FaultStore::injected).unwrap_or_default();
    serde_json::json!({
        "ops": c.ops, "errors": c.errors, "timeouts": c.timeouts,
        "partial": c.partial, "lost_acks": c.lost_acks,
    })
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

/// Wait for a save; its report line.
async fn finish(h: SaveHandle, faults: Option<&FaultStore>) -> serde_json::Value {
    let step = h.id().step;
    let mut line = match h.wait().await {
        Ok(_) => {
            println!("checkpoint {step} committed");
            serde_json::json!({"event": "save", "step": step, "ok": true})
        }
        Err(e) => {
            println!("checkpoint {step} failed: {e}");
            serde_json::json!({
                "event": "save", "step": step, "ok": false,
                "kind": error_kind(&e), "error": e.to_string(),
            })
        }
    };
    line["faults"] = counts(faults);
    line
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
    if a.lazy {
        builder = builder.snapshot(SnapshotMode::Lazy);
    }
    let cp = builder.build().await?;

    let mut step = 0u64;
    let t_load = Instant::now();
    let loaded = cp.load_latest().await?;
    let load_ms = t_load.elapsed().as_secs_f64() * 1e3;
    let mut start_line = serde_json::json!({
        "event": "start",
        "pid": std::process::id(),
        "load_ms": load_ms,
        "since_exec_ms": t0.elapsed().as_secs_f64() * 1e3,
        "resumed_from": null,
        "attempt": null,
        "skipped": [],
    });
    match loaded {
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
            start_line["resumed_from"] = step.into();
            start_line["attempt"] = l.id.attempt.clone().into();
            start_line["skipped"] = l
                .skipped
                .iter()
                .map(|(id, e)| {
                    serde_json::json!({
                        "step": id.step, "attempt": id.attempt,
                        "kind": error_kind(e), "error": e.to_string(),
                    })
                })
                .collect();
            println!("resumed from step {step}");
        }
        None => {
            // `load_latest` does not return what it skipped when nothing loads:
            // ask each committed checkpoint, newest first, as it did.
            let mut skipped = Vec::new();
            for id in cp.committed().await?.into_iter().rev() {
                match cp.load(&id).await {
                    Err(e) if e.is_damage() => skipped.push(serde_json::json!({
                        "step": id.step, "attempt": id.attempt,
                        "kind": error_kind(&e), "error": e.to_string(),
                    })),
                    Err(e) => return Err(e),
                    Ok(_) => {
                        return Err(Error::Internal(format!(
                            "load_latest found nothing, but {id} loads"
                        )))
                    }
                }
            }
            start_line["skipped"] = skipped.into();
            println!("fresh start");
        }
    }
    report.line(start_line);

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
            report.line(serde_json::json!({
                "event": "first_step", "step": step,
                "since_exec_ms": t0.elapsed().as_secs_f64() * 1e3,
                "faults": counts(faults.as_ref()),
            }));
        }
        if step % a.every == 0 {
            if let Some(h) = pending.take() {
                report.line(finish(h, faults.as_ref()).await);
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
                    report.line(serde_json::json!({
                        "event": "save", "step": step, "ok": false,
                        "kind": error_kind(&e), "error": e.to_string(),
                        "faults": counts(faults.as_ref()),
                    }));
                }
            }
        }
    }
    if let Some(h) = pending.take() {
        report.line(finish(h, faults.as_ref()).await);
    }
    let tmp = a.out.with_extension("tmp");
    {
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(&dump(&vs))?;
        f.sync_all()?;
    }
    std::fs::rename(&tmp, &a.out)?;
    report.line(serde_json::json!({
        "event": "done", "step": step, "faults": counts(faults.as_ref()),
    }));
    println!("done {step}");
    Ok(step)
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let t0 = Instant::now();
    let a = match parse() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("fault_victim: {e}");
            std::process::exit(2);
        }
    };
    let mut report = Report(if a.report.as_os_str().is_empty() {
        None
    } else {
        std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&a.report)
            .ok()
    });
    if let Err(e) = train(&a, &mut report, t0).await {
        report.line(serde_json::json!({
            "event": "error", "kind": error_kind(&e), "error": e.to_string(),
        }));
        eprintln!("fault_victim: {e}");
        std::process::exit(1);
    }
}
