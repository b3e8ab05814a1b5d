//! The suite: the list of experiments (one line each in [`suite!`]), the
//! options they share, and a run of some of them, gathered for the report.
//!
//! Each experiment's options are flattened twice: into [`SuiteArgs`] (so
//! `ckpt-eval --sharded-ranks 2,4` sizes the suite's sharded run) and into its
//! own subcommand (`ckpt-eval sharded --sharded-ranks 2,4`).

use std::path::PathBuf;
use std::time::Instant;

use serde::Serialize;

use crate::experiments::{Ctx, Error, Experiment, Output, StateSpec};
use crate::models::{DtypeMix, MODELS};

/// The options every experiment shares.
#[derive(clap::Args, Debug, Clone)]
pub struct Common {
    /// Directory on the disk under test (checkpoints are written and deleted here).
    #[arg(long, global = true, default_value = "runs/scratch")]
    pub scratch: PathBuf,
    /// Where results go (a new run directory is made inside).
    #[arg(long, global = true, default_value = "runs")]
    pub out: PathBuf,
    /// Repeats of each measurement.
    #[arg(long, global = true, default_value_t = 3)]
    pub repeats: usize,
    /// The heavy configurations (more ranks, larger states, more repeats) for
    /// every option not given; the default suite takes a few minutes on 2 cores.
    #[arg(long, global = true)]
    pub full: bool,
    /// Model whose tensor shapes the shared state takes (resnet50, bert-large, gpt2-xl, llama3-8b).
    #[arg(long, global = true, default_value = "gpt2-xl")]
    pub model: String,
    /// Size of the shared model-shaped state in MiB (parameters plus optimizer
    /// state) [default: 64; --full: 256].
    #[arg(long, global = true)]
    pub mib: Option<usize>,
    /// Dtype mix: fp32, or bf16 (bf16 parameters, f32 master copy and moments).
    #[arg(long, global = true, default_value = "fp32")]
    pub dtype: String,
    /// Leave the Adam optimizer state out.
    #[arg(long, global = true)]
    pub no_optimizer: bool,
    /// Skip the Python baselines and experiments.
    #[arg(long, global = true)]
    pub no_python: bool,
    /// No progress bars.
    #[arg(long, global = true)]
    pub quiet: bool,
    /// Root URL on an S3 server (`s3://bucket/prefix`, credentials from the
    /// AWS_* variables) for the experiments that use one (`s3`, and `memtier`'s
    /// restart from S3); without it they leave S3 out.
    #[arg(long, global = true, env = "CKPT_EVAL_S3_URL")]
    pub s3_url: Option<String>,
}

impl Common {
    /// The context of a run with these options.
    pub fn ctx(&self) -> Result<Ctx, Error> {
        let mix = DtypeMix::parse(&self.dtype)
            .ok_or_else(|| format!("--dtype must be fp32 or bf16, not {:?}", self.dtype))?;
        if !MODELS.contains(&self.model.as_str()) {
            return Err(format!("--model must be one of {MODELS:?}").into());
        }
        std::fs::create_dir_all(&self.scratch)?;
        let python = if self.no_python {
            None
        } else {
            crate::python::interpreter()
        };
        let mut ctx = Ctx::new(
            std::fs::canonicalize(&self.scratch)?,
            self.repeats,
            python,
            !self.quiet,
        );
        ctx.full = self.full;
        ctx.s3_url = self.s3_url.clone();
        ctx.spec = StateSpec {
            model: self.model.clone(),
            mib: self.mib.unwrap_or(if self.full { 256 } else { 64 }),
            mix,
            optimizer: !self.no_optimizer,
        };
        Ok(ctx)
    }
}

/// The list of experiments: `field: Type => Subcommand, "its help";`, in the
/// suite's order. Adding an experiment is its module and one line here.
macro_rules! suite {
    ($($field:ident: $ty:ty => $variant:ident, $doc:literal;)*) => {
        /// Every experiment's options, flattened into the suite.
        #[derive(clap::Args, Debug, Clone, Default)]
        pub struct SuiteArgs {
            $(
                #[allow(missing_docs)]
                #[command(flatten)]
                pub $field: $ty,
            )*
        }

        /// The subcommands: the suite, or one experiment with its own options.
        // Parsed once per run: the suite's variant being large costs nothing.
        #[allow(clippy::large_enum_variant)]
        #[derive(clap::Subcommand, Debug, Clone)]
        pub enum Cmd {
            /// The default suite (every experiment); also what runs with no subcommand.
            Suite(SuiteArgs),
            $(
                #[doc = $doc]
                $variant($ty),
            )*
        }

        impl SuiteArgs {
            /// Every experiment, in the suite's order.
            pub fn experiments(&self) -> Vec<Box<dyn Experiment>> {
                vec![$(Box::new(self.$field.clone()) as Box<dyn Experiment>),*]
            }
        }

        impl Cmd {
            /// What this subcommand runs: the suite's experiments, or one with
            /// those it needs (taken from `suite`) before it.
            pub fn experiments(&self, suite: &SuiteArgs) -> Vec<Box<dyn Experiment>> {
                let one: Box<dyn Experiment> = match self {
                    Cmd::Suite(s) => return s.experiments(),
                    $(Cmd::$variant(x) => Box::new(x.clone()),)*
                };
                let mut v: Vec<Box<dyn Experiment>> = suite
                    .experiments()
                    .into_iter()
                    .filter(|e| one.needs().contains(&e.name()))
                    .collect();
                v.push(one);
                v
            }
        }
    };
}

suite! {
    engine: crate::experiments::engine::Engine => Engine,
        "The engine benchmark: stall, time to commit, memory, incremental bytes.";
    formats: crate::experiments::formats::Formats => Formats,
        "Formats: ckpt's formats and the Python baselines, save/load/size.";
    overhead: crate::experiments::overhead::Overhead => Overhead,
        "Overhead of checkpointing a training loop every k steps.";
    determinism: crate::experiments::determinism::Determinism => Determinism,
        "Byte-identical saves and bitwise resume.";
    interference: crate::experiments::interference::Interference => Interference,
        "Checkpoints under memory/disk/CPU/network noise, and the reverse.";
    interval: crate::experiments::interval::Interval => Interval,
        "Young/Daly interval and goodput from measured costs (runs formats and overhead).";
    scale: crate::experiments::scale::Scale => Scale,
        "Ranks under mpirun, with and without dedup (needs the `mpi` feature); thousands of ranks simulated in this process (`--simulate`: only those).";
    sharded: crate::experiments::sharded::Sharded => Sharded,
        "FSDP2 state under torchrun: ckpt beside dcp and torch-checkpointing.";
    fsdp_scale: crate::experiments::fsdp_scale::FsdpScale => FsdpScale,
        "Many small FSDP2 tensors under torchrun at growing rank counts: ckpt's coordination and metadata beside DCP's.";
    python: crate::experiments::pytrain::Python => Python,
        "A GPT-2-shaped PyTorch model and AdamW from Python: ckpt beside its peers, and real training loops.";
    recovery: crate::experiments::recovery::Recovery => Recovery,
        "Restarts after SIGKILLs of a PyTorch job (ckpt-faults, evaluator/python/recovery_victim.py) beside torch.save.";
    memtier: crate::experiments::memtier::Memtier => Memtier,
        "Restart to first step from the memory tier, a peer's replica, local disk, S3 and torch.load (evaluator/python/memtier_bench.py).";
    gpu: crate::experiments::gpu::Gpu => Gpu,
        "A model training on a CUDA device checkpointed by ckpt and its peers (evaluator/python/gpu_bench.py).";
    s3: crate::experiments::s3::S3 => S3,
        "Save and load on S3 beside a plain multipart upload and ranged download (needs --s3-url).";
}

/// What one experiment of a run came to.
#[derive(Debug, Serialize)]
pub struct Ran {
    /// Its name.
    pub name: String,
    /// Seconds it took.
    pub secs: f64,
    /// Why it did not run or measured nothing, if so.
    pub not_run: Option<String>,
    /// Its error, if it failed.
    pub error: Option<String>,
    /// What it measured, rendered.
    #[serde(rename = "results", serialize_with = "output_results")]
    pub output: Output,
}

fn output_results<S: serde::Serializer>(o: &Output, s: S) -> Result<S::Ok, S::Error> {
    o.results.serialize(s)
}

/// Everything a run measured (what `results.json` holds).
#[derive(Debug, Serialize, Default)]
pub struct SuiteResults {
    /// The shared state's settings.
    pub state: Option<StateSpec>,
    /// Bytes and tensors of the shared state, if an experiment made it.
    pub state_made: Option<(u64, usize)>,
    /// Repeats per figure.
    pub repeats: usize,
    /// The machine's floors for the shared state, if measured.
    pub limits: Option<crate::limits::Limits>,
    /// Each experiment, in the order they ran.
    pub experiments: Vec<Ran>,
}

impl SuiteResults {
    /// Experiments that did not run or measured nothing, with why.
    pub fn not_run(&self) -> impl Iterator<Item = (&str, &str)> {
        self.experiments
            .iter()
            .filter_map(|r| Some((r.name.as_str(), r.not_run.as_deref()?)))
    }

    /// Experiments that failed, with the error.
    pub fn errors(&self) -> impl Iterator<Item = (&str, &str)> {
        self.experiments
            .iter()
            .filter_map(|r| Some((r.name.as_str(), r.error.as_deref()?)))
    }
}

fn minutes(s: f64) -> String {
    if s < 90.0 {
        format!("{:.0} s", s.max(1.0))
    } else {
        format!("{:.0} min", s / 60.0)
    }
}

/// Run `experiments` in order. Progress on stderr names each as it starts,
/// with an estimate of what is left (the estimates, scaled by how the ones so
/// far compared with what they took).
pub async fn run(ctx: &Ctx, experiments: &[Box<dyn Experiment>]) -> SuiteResults {
    let mut r = SuiteResults {
        state: Some(ctx.spec.clone()),
        repeats: ctx.repeats,
        ..Default::default()
    };
    let estimates: Vec<f64> = experiments.iter().map(|e| e.estimate_s(ctx)).collect();
    let (mut estimated_done, mut took_done) = (0.0, 0.0);
    for (i, e) in experiments.iter().enumerate() {
        let name = e.name();
        let mut ran = Ran {
            name: name.into(),
            secs: 0.0,
            not_run: None,
            error: None,
            output: Output::default(),
        };
        if let Some(why) = e.unavailable(ctx) {
            eprintln!("[{}/{}] {name}: not run: {why}", i + 1, experiments.len());
            ran.not_run = Some(why);
            r.experiments.push(ran);
            continue;
        }
        let pace = if estimated_done > 0.0 {
            took_done / estimated_done
        } else {
            1.0
        };
        let left: f64 = estimates[i..].iter().sum::<f64>() * pace;
        eprintln!(
            "[{}/{}] {name}: {} (about {}; about {} left in this run)",
            i + 1,
            experiments.len(),
            e.about(ctx),
            minutes(estimates[i] * pace),
            minutes(left)
        );
        let t = Instant::now();
        match e.run(ctx).await {
            Ok(out) => {
                ran.not_run = out.not_run.clone();
                ran.output = out;
            }
            Err(err) => {
                eprintln!("{name} failed: {err}");
                ran.error = Some(err.to_string());
            }
        }
        ran.secs = t.elapsed().as_secs_f64();
        estimated_done += estimates[i];
        took_done += ran.secs;
        r.experiments.push(ran);
    }
    if let Some(s) = ctx.state_made() {
        r.state_made = Some((s.0.nbytes(), s.0.tensors.len()));
        r.limits = Some(s.1.clone());
    }
    r
}
