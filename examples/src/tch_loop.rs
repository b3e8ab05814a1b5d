//! The resumable tch training loop behind the `tch_train` example and the fault
//! campaign's victim (`fault_victim` in ckpt-faults).
//!
//! An MLP with dropout learns a fixed random "teacher" function from generated
//! batches, with [`Adam`] (whose state ckpt can save). Every `every` steps it saves
//! the model, the optimizer and its position; at start-up it resumes from the newest
//! committed checkpoint. Randomness depends only on `(seed, step)` ([`rng::reseed`]
//! at the top of every step), so a killed and restarted run computes exactly what
//! an uninterrupted one does.
//!
//! [`train`] is the plain loop; [`train_with`] runs the same loop with [`Hooks`]:
//! another model, another checkpointer (a store that injects faults), reports at
//! each event, and training that goes on when a save fails. [`Trainer`] is what
//! both train (model, optimizer, teacher, one step), for code that restarts the
//! same state another way (`crate::torch_file`).
//!
//! It prints one line per event, which the crash tests and the fault campaign
//! read: `fresh start`, `resumed from step N`, `step N loss L`,
//! `checkpoint N started`, `checkpoint N committed`, `checkpoint N failed: ...`,
//! `done N`.

use std::path::PathBuf;
use std::time::Instant;

use ckpt_core::torch::tch::nn::{self, ModuleT};
use ckpt_core::torch::tch::{self, Device, Kind, Tensor};
use ckpt_core::torch::{restore, rng, Adam, AdamConfig, TorchCapture};
use ckpt_core::{
    Checkpointer, CheckpointerBuilder, Error, Loaded, Result, Retention, SaveHandle, SnapshotMode,
    Value,
};

/// Features of an input.
pub const INPUTS: i64 = 32;
/// Width of the hidden layers of the default model.
pub const HIDDEN: i64 = 128;
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

/// `cpu` or `cuda` (device 0), as the command lines spell them.
pub fn parse_device(name: &str) -> std::result::Result<Device, String> {
    match name {
        "cpu" => Ok(Device::Cpu),
        "cuda" => Ok(Device::Cuda(0)),
        other => Err(format!("unknown device {other} (cpu or cuda)")),
    }
}

/// The MLP: `INPUTS` -> `hidden` -> dropout -> `hidden` -> `OUTPUTS`, ReLUs
/// between, its variables under `p`.
pub fn mlp(p: &nn::Path, hidden: i64) -> nn::SequentialT {
    nn::seq_t()
        .add(nn::linear(p / "l1", INPUTS, hidden, Default::default()))
        .add_fn(|x| x.relu())
        .add_fn_t(|x, train| x.dropout(0.1, train))
        .add(nn::linear(p / "l2", hidden, hidden, Default::default()))
        .add_fn(|x| x.relu())
        .add(nn::linear(p / "l3", hidden, OUTPUTS, Default::default()))
}

/// What a job built on the loop adds to it. Every method has a default, and the
/// defaults are the plain loop of [`train`].
#[allow(async_fn_in_trait)]
pub trait Hooks {
    /// The model, built right after its `VarStore` (torch's generator is seeded
    /// with the run's seed): what it draws from the generator, in the same order
    /// in every process, is its initial weights. Default: [`mlp`] of [`HIDDEN`].
    fn model(&mut self, vs: &nn::VarStore, cfg: &TrainConfig) -> Result<nn::SequentialT> {
        let _ = cfg;
        Ok(mlp(&vs.root(), HIDDEN))
    }

    /// The checkpointer's builder; the loop sets retention (`keep`) and the
    /// snapshot mode on it. Default: `ckpt_formats::builder(root)`.
    fn checkpointer(&mut self, cfg: &TrainConfig) -> Result<CheckpointerBuilder> {
        Ok(ckpt_formats::builder(cfg.root.clone()))
    }

    /// After `load_latest` (which took `load_ms`): what it loaded, already
    /// restored, or `None` for a fresh start. An error stops the job.
    async fn loaded(
        &mut self,
        cp: &Checkpointer,
        loaded: Option<&Loaded>,
        load_ms: f64,
    ) -> Result<()> {
        let _ = (cp, loaded, load_ms);
        Ok(())
    }

    /// After each optimizer step.
    fn stepped(&mut self, step: u64) {
        let _ = step;
    }

    /// The snapshot of the save in flight failed. Default: stop with its error;
    /// `Ok` goes on, and the save's error comes to [`Hooks::save_ended`].
    fn snapshot_failed(&mut self, step: u64, e: Error) -> Result<()> {
        let _ = step;
        Err(e)
    }

    /// A save ended: `Ok`, committed. Default: a failed save stops the job with
    /// its error; `Ok` goes on without that checkpoint.
    fn save_ended(&mut self, step: u64, result: Result<()>) -> Result<()> {
        let _ = step;
        result
    }

    /// Training is done and the final weights are written.
    fn done(&mut self, step: u64) {
        let _ = step;
    }
}

/// The plain loop's hooks: every default.
#[derive(Debug, Default, Clone, Copy)]
pub struct Plain;

impl Hooks for Plain {}

/// What the loop trains: the model, its variables, the optimizer and the teacher
/// it learns. Every process of a run builds the same one ([`Trainer::new`]), then
/// puts a checkpoint's state into it.
pub struct Trainer {
    /// The model's variables.
    pub vs: nn::VarStore,
    /// The optimizer.
    pub opt: Adam,
    net: nn::SequentialT,
    teacher: Tensor,
    seed: u64,
    device: Device,
}

impl Trainer {
    /// Seed torch with the run's seed and build the model (`hooks.model`), its
    /// Adam and the teacher, as every start of the run does. Also sets torch to one
    /// intra-op thread: the same reductions in the same order in every process.
    pub fn new(cfg: &TrainConfig, hooks: &mut impl Hooks) -> Result<Self> {
        tch::set_num_threads(1);
        tch::manual_seed(cfg.seed as i64);
        let vs = nn::VarStore::new(cfg.device);
        let net = hooks.model(&vs, cfg)?;
        let opt = Adam::new(
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
        Ok(Trainer {
            vs,
            opt,
            net,
            teacher,
            seed: cfg.seed,
            device: cfg.device,
        })
    }

    /// The forward and backward pass of the step that follows `step` (its batch
    /// and dropout drawn from `(seed, step)`): gradients are left for
    /// [`Trainer::apply`]. Returns the loss.
    pub fn backward(&mut self, step: u64) -> Tensor {
        rng::reseed(self.seed, step);
        let x = Tensor::randn([BATCH, INPUTS], (Kind::Float, self.device));
        let y = x.matmul(&self.teacher).tanh();
        let loss = self
            .net
            .forward_t(&x, true)
            .mse_loss(&y, tch::Reduction::Mean);
        self.opt.zero_grad();
        loss.backward();
        loss
    }

    /// The optimizer step after [`Trainer::backward`].
    pub fn apply(&mut self) -> Result<()> {
        self.opt.step()
    }

    /// What a checkpoint of step `step` holds: the variables under `model/`, the
    /// optimizer under `optim/`, the step and the seed as meta.
    pub fn capture(&self, step: u64) -> Result<TorchCapture> {
        let mut cap = TorchCapture::new();
        cap.var_store("model/", &self.vs)?;
        self.opt.capture("optim/", &mut cap)?;
        cap.meta("step", Value::Int(step as i64));
        cap.meta("seed", Value::Int(self.seed as i64));
        Ok(cap)
    }

    /// Put a loaded checkpoint's state in place; returns its step. A checkpoint of
    /// a run with another seed is refused.
    pub fn restore(&mut self, loaded: &Loaded, root: &str) -> Result<u64> {
        let meta = &loaded.state.meta;
        if meta.get("seed").and_then(Value::as_int) != Some(self.seed as i64) {
            return Err(Error::InvalidInput(format!(
                "the checkpoint under {root} belongs to a run with another seed"
            )));
        }
        let step = meta
            .get("step")
            .and_then(Value::as_int)
            .and_then(|s| u64::try_from(s).ok())
            .ok_or_else(|| Error::InvalidInput("checkpoint without a step".into()))?;
        restore::var_store(&mut self.vs, &loaded.state, "model/")?;
        self.opt.restore("optim/", &loaded.state)?;
        Ok(step)
    }

    /// The run's seed.
    pub fn seed(&self) -> u64 {
        self.seed
    }
}

/// Print how the save of `step` ended and hand it to the hooks.
fn end_save(hooks: &mut impl Hooks, step: u64, result: Result<()>) -> Result<()> {
    match &result {
        Ok(()) => println!("checkpoint {step} committed"),
        Err(e) => println!("checkpoint {step} failed: {e}"),
    }
    hooks.save_ended(step, result)
}

async fn finish(hooks: &mut impl Hooks, h: SaveHandle) -> Result<()> {
    let step = h.id().step;
    let result = h.wait().await.map(drop);
    end_save(hooks, step, result)
}

/// Train, resuming from the newest checkpoint under `cfg.root` if there is one.
pub async fn train(cfg: &TrainConfig) -> Result<Outcome> {
    train_with(cfg, &mut Plain).await
}

/// [`train`] with `hooks`.
pub async fn train_with(cfg: &TrainConfig, hooks: &mut impl Hooks) -> Result<Outcome> {
    if cfg.every == 0 {
        return Err(Error::InvalidInput("--every must be at least 1".into()));
    }
    let mut tr = Trainer::new(cfg, hooks)?;

    let mut builder = hooks
        .checkpointer(cfg)?
        .retention(Retention::keep_last(cfg.keep));
    if cfg.lazy {
        builder = builder.snapshot(SnapshotMode::Lazy);
    }
    let cp = builder.build().await?;

    let mut step = 0u64;
    let t_load = Instant::now();
    let loaded = cp.load_latest().await?;
    let load_ms = t_load.elapsed().as_secs_f64() * 1e3;
    if let Some(loaded) = &loaded {
        step = tr.restore(loaded, &cfg.root)?;
    }
    hooks.loaded(&cp, loaded.as_ref(), load_ms).await?;
    let resumed_from = loaded.map(|_| step);
    match resumed_from {
        Some(step) => println!("resumed from step {step}"),
        None => println!("fresh start"),
    }

    let mut pending: Option<SaveHandle> = None;
    while step < cfg.steps {
        let loss = tr.backward(step);
        if let Some(h) = &pending {
            // The snapshot must be complete before the step mutates what it copies.
            if let Err(e) = h.wait_snapshot().await {
                hooks.snapshot_failed(h.id().step, e)?;
            }
        }
        tr.apply()?;
        step += 1;
        println!("step {step} loss {:.6}", loss.double_value(&[]));
        hooks.stepped(step);
        if step % cfg.every == 0 {
            if let Some(h) = pending.take() {
                finish(hooks, h).await?;
            }
            match cp.save(step, tr.capture(step)?).await {
                Ok(h) => {
                    println!("checkpoint {step} started");
                    pending = Some(h);
                }
                Err(e) => end_save(hooks, step, Err(e))?,
            }
        }
    }
    if let Some(h) = pending.take() {
        finish(hooks, h).await?;
    }
    if let Some(out) = &cfg.out {
        crate::weights::write(&tr.vs, out)?;
    }
    hooks.done(step);
    println!("done {step}");
    Ok(Outcome {
        resumed_from,
        finished_at: step,
    })
}
