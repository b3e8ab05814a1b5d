//! The resumable tch training loop behind the `tch_train` example.
//!
//! An MLP with dropout learns a fixed random "teacher" function from generated
//! batches, with [`Adam`] (whose state ckpt can save). Every `every` steps it saves
//! the model, the optimizer and its position; at start-up it resumes from the newest
//! committed checkpoint. Randomness depends only on `(seed, step)` ([`rng::reseed`]
//! at the top of every step), so a killed and restarted run computes exactly what
//! an uninterrupted one does.
//!
//! It prints one line per event, which the crash tests read: `fresh start`,
//! `resumed from step N`, `step N loss L`, `checkpoint N started`, `done N`.

use std::path::PathBuf;

use ckpt_core::torch::tch::nn::{self, ModuleT};
use ckpt_core::torch::tch::{self, Device, Kind, Tensor};
use ckpt_core::torch::{restore, rng, Adam, AdamConfig, TorchCapture};
use ckpt_core::{Error, Result, Retention, SaveHandle, SnapshotMode, Value};

const INPUTS: i64 = 32;
const HIDDEN: i64 = 128;
const OUTPUTS: i64 = 8;
const BATCH: i64 = 64;

/// What to train and where to checkpoint.
#[derive(Debug, Clone)]
pub struct TrainConfig {
    /// Checkpoint root (a directory path or a URL).
    pub root: String,
    /// Train until this many optimizer steps are done.
    pub steps: u64,
    /// Checkpoint every this many steps.
    pub every: u64,
    /// The run's seed (initial weights, teacher, every batch and dropout mask).
    pub seed: u64,
    /// Where the model lives.
    pub device: Device,
    /// Lazy snapshot (the copy overlaps the next forward and backward).
    pub lazy: bool,
    /// Checkpoints to keep.
    pub keep: usize,
    /// Where to write the final weights (see [`crate::weights`]).
    pub out: Option<PathBuf>,
}

/// What a call of [`train`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Outcome {
    /// The step it resumed from, if it found a checkpoint.
    pub resumed_from: Option<u64>,
    /// The step it finished at.
    pub finished_at: u64,
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

fn capture(vs: &nn::VarStore, opt: &Adam, step: u64, seed: u64) -> Result<TorchCapture> {
    let mut cap = TorchCapture::new();
    cap.var_store("model/", vs)?;
    opt.capture("optim/", &mut cap)?;
    cap.meta("step", Value::Int(step as i64));
    cap.meta("seed", Value::Int(seed as i64));
    Ok(cap)
}

/// Train, resuming from the newest checkpoint under `cfg.root` if there is one.
pub async fn train(cfg: &TrainConfig) -> Result<Outcome> {
    if cfg.every == 0 {
        return Err(Error::InvalidInput("--every must be at least 1".into()));
    }
    // One thread: the same reductions in the same order in every process.
    tch::set_num_threads(1);
    tch::manual_seed(cfg.seed as i64);
    let mut vs = nn::VarStore::new(cfg.device);
    let net = model(&vs.root());
    let mut opt = Adam::new(
        &vs,
        AdamConfig {
            lr: 3e-3,
            weight_decay: 1e-5,
            ..Default::default()
        },
    )?;
    // The teacher depends on the seed alone, not on how far the run got.
    rng::reseed(cfg.seed, u64::MAX);
    let teacher =
        Tensor::randn([INPUTS, OUTPUTS], (Kind::Float, Device::Cpu)).to_device(cfg.device);

    let mut builder =
        ckpt_formats::builder(cfg.root.clone()).retention(Retention::keep_last(cfg.keep));
    if cfg.lazy {
        builder = builder.snapshot(SnapshotMode::Lazy);
    }
    let cp = builder.build().await?;

    let mut step = 0u64;
    let mut resumed_from = None;
    match cp.load_latest().await? {
        Some(loaded) => {
            let meta = &loaded.state.meta;
            if meta.get("seed").and_then(Value::as_int) != Some(cfg.seed as i64) {
                return Err(Error::InvalidInput(format!(
                    "the checkpoint under {} belongs to a run with another seed",
                    cfg.root
                )));
            }
            step = meta
                .get("step")
                .and_then(Value::as_int)
                .and_then(|s| u64::try_from(s).ok())
                .ok_or_else(|| Error::InvalidInput("checkpoint without a step".into()))?;
            restore::var_store(&mut vs, &loaded.state, "model/")?;
            opt.restore("optim/", &loaded.state)?;
            resumed_from = Some(step);
            println!("resumed from step {step}");
        }
        None => println!("fresh start"),
    }

    let mut pending: Option<SaveHandle> = None;
    while step < cfg.steps {
        rng::reseed(cfg.seed, step);
        let x = Tensor::randn([BATCH, INPUTS], (Kind::Float, cfg.device));
        let y = x.matmul(&teacher).tanh();
        let loss = net.forward_t(&x, true).mse_loss(&y, tch::Reduction::Mean);
        opt.zero_grad();
        loss.backward();
        if let Some(h) = &pending {
            // The snapshot must be complete before the step mutates what it copies.
            h.wait_snapshot().await?;
        }
        opt.step()?;
        step += 1;
        println!("step {step} loss {:.6}", loss.double_value(&[]));
        if step % cfg.every == 0 {
            if let Some(h) = pending.take() {
                h.wait().await?;
            }
            pending = Some(cp.save(step, capture(&vs, &opt, step, cfg.seed)?).await?);
            println!("checkpoint {step} started");
        }
    }
    if let Some(h) = pending.take() {
        h.wait().await?;
    }
    if let Some(out) = &cfg.out {
        crate::weights::write(&vs, out)?;
    }
    println!("done {step}");
    Ok(Outcome {
        resumed_from,
        finished_at: step,
    })
}
