//! The experiments of `ckpt-eval`, one module each, and what they share: the
//! [`Experiment`] trait, the context every run gets ([`Ctx`]), and what a run
//! hands to the report ([`Output`]).
//!
//! An experiment is its clap options (flattened into the suite and into its own
//! subcommand, see [`crate::suite`]) and implements [`Experiment`]: it runs and
//! renders its own tables, charts and targets. The report knows tables and
//! charts, never experiments.

pub mod determinism;
pub mod engine;
pub mod formats;
pub mod fsdp_scale;
pub mod gpu;
pub mod interference;
pub mod interval;
pub mod memtier;
pub mod overhead;
pub mod pytrain;
pub mod recovery;
pub mod s3;
pub mod scale;
pub mod script;
pub mod sharded;

use std::any::Any;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use ckpt_core::State;
use indicatif::{ProgressBar, ProgressStyle};
use serde::Serialize;

pub use crate::error::Error;
use crate::limits::Limits;
use crate::models::{DtypeMix, ModelState};
use crate::plot::Chart;
use crate::table::Table;

/// One experiment of the suite.
#[async_trait]
pub trait Experiment: Send + Sync {
    /// Its name (also its subcommand's and its section's).
    fn name(&self) -> &'static str;
    /// One line said when it starts: what it runs, at what size.
    fn about(&self, ctx: &Ctx) -> String;
    /// A rough estimate of its seconds on a 2-core machine, for the progress line.
    fn estimate_s(&self, ctx: &Ctx) -> f64;
    /// Experiments whose results it reads ([`Ctx::kept`]), run before it when
    /// it runs alone.
    fn needs(&self) -> &'static [&'static str] {
        &[]
    }
    /// Why it cannot run here (checked before it would start), if it cannot.
    fn unavailable(&self, _ctx: &Ctx) -> Option<String> {
        None
    }
    /// Run it and render what it measured.
    async fn run(&self, ctx: &Ctx) -> Result<Output, Error>;
}

/// What a run hands to the report.
#[derive(Debug, Default)]
pub struct Output {
    /// What `results.json` holds for it.
    pub results: serde_json::Value,
    /// Its tables, in order.
    pub tables: Vec<Table>,
    /// Its plots by file stem; each goes under the table whose id its stem starts with.
    pub charts: Vec<(String, Chart)>,
    /// Its targets (the report gathers every experiment's in one section).
    pub targets: Vec<Target>,
    /// Lines for the report's notes (a peer that is missing, and why).
    pub notes: Vec<String>,
    /// A figure for the top of the report.
    pub summary: Option<Chart>,
    /// It ran but measured nothing, and why (listed at the top of the report).
    pub not_run: Option<String>,
}

impl Output {
    /// An output of `results` (serialised for `results.json`) and nothing else yet.
    pub fn of<T: Serialize>(results: &T) -> Output {
        Output {
            results: serde_json::to_value(results).unwrap_or_default(),
            ..Default::default()
        }
    }
}

/// One target: a measured value (a ratio, or a time) and the bound it must
/// stay under.
#[derive(Debug, Clone, Serialize)]
pub struct Target {
    /// What is compared.
    pub what: String,
    /// Measured value (ratios are of medians).
    pub ratio: f64,
    /// The bound.
    pub bound: f64,
    /// Whether it is met (`ratio <= bound` unless the experiment says otherwise).
    pub met: bool,
}

impl Target {
    /// A measured `ratio` against its `bound` (met when not above it).
    pub fn new(what: impl Into<String>, ratio: f64, bound: f64) -> Target {
        Target {
            what: what.into(),
            ratio,
            bound,
            met: ratio <= bound,
        }
    }
}

/// The model-shaped state several experiments share, and how it is made.
#[derive(Debug, Clone, Serialize)]
pub struct StateSpec {
    /// Model whose tensor shapes it takes.
    pub model: String,
    /// Size in MiB (parameters and optimizer state).
    pub mib: usize,
    /// Dtype mix.
    pub mix: DtypeMix,
    /// With Adam state.
    pub optimizer: bool,
}

impl StateSpec {
    /// Generate it with `seed`, `mib` MiB of it.
    pub fn build(&self, mib: usize, seed: u64) -> Result<State, String> {
        ModelState {
            model: self.model.clone(),
            bytes: mib << 20,
            mix: self.mix,
            optimizer: self.optimizer,
            seed,
        }
        .build()
    }
}

/// What every experiment gets.
#[derive(Debug)]
pub struct Ctx {
    /// Directory on the disk under test (checkpoints are written and deleted here).
    pub scratch: PathBuf,
    /// Repeats of each measurement.
    pub repeats: usize,
    /// The Python interpreter for the baselines (`None`: baselines are left out).
    pub python: Option<PathBuf>,
    /// Show progress bars (on a terminal).
    pub progress: bool,
    /// The heavy configurations (`--full`) where an option is not given.
    pub full: bool,
    /// The model-shaped state of the experiments that share one.
    pub spec: StateSpec,
    /// The S3 server's root URL the experiments that use S3 are given, if any.
    pub s3_url: Option<String>,
    shared: tokio::sync::OnceCell<Arc<(State, Limits)>>,
    kept: Mutex<Vec<Arc<dyn Any + Send + Sync>>>,
}

impl Ctx {
    /// A context with the default state (128 MiB shaped like GPT-2 XL, fp32, with Adam).
    pub fn new(scratch: PathBuf, repeats: usize, python: Option<PathBuf>, progress: bool) -> Ctx {
        Ctx {
            scratch,
            repeats: repeats.max(1),
            python,
            progress,
            full: false,
            spec: StateSpec {
                model: "gpt2-xl".into(),
                mib: 128,
                mix: DtypeMix::Fp32,
                optimizer: true,
            },
            s3_url: None,
            shared: tokio::sync::OnceCell::new(),
            kept: Mutex::new(Vec::new()),
        }
    }

    /// The shared state and the machine's floors for it, made and measured
    /// by the first experiment that asks.
    pub async fn state(&self) -> Result<Arc<(State, Limits)>, Error> {
        self.shared
            .get_or_try_init(|| async {
                let state = self.spec.build(self.spec.mib, 1)?;
                eprintln!(
                    "  state: {} shapes, {:?}, optimizer {}: {:.1} MiB in {} tensors; measuring the floors",
                    self.spec.model,
                    self.spec.mix,
                    self.spec.optimizer,
                    state.nbytes() as f64 / (1 << 20) as f64,
                    state.tensors.len()
                );
                let lim = Limits::measure(&state, &self.scratch, self.repeats)?;
                Ok::<_, Error>(Arc::new((state, lim)))
            })
            .await
            .cloned()
    }

    /// The shared state and floors, if an experiment made them.
    pub fn state_made(&self) -> Option<Arc<(State, Limits)>> {
        self.shared.get().cloned()
    }

    /// Keep `v` for experiments that run later ([`Experiment::needs`]).
    pub fn keep<T: Any + Send + Sync>(&self, v: T) {
        if let Ok(mut k) = self.kept.lock() {
            k.push(Arc::new(v));
        }
    }

    /// The last value of type `T` an experiment kept.
    pub fn kept<T: Any + Send + Sync + Clone>(&self) -> Option<T> {
        let k = self.kept.lock().ok()?;
        k.iter().rev().find_map(|v| v.downcast_ref::<T>().cloned())
    }

    /// A progress bar of `len` steps, hidden when progress is off or stderr is not
    /// a terminal.
    pub fn bar(&self, len: u64, what: &str) -> ProgressBar {
        if !self.progress {
            return ProgressBar::hidden();
        }
        let pb = ProgressBar::new(len);
        pb.set_style(
            ProgressStyle::with_template("{prefix:>14} [{bar:30}] {pos}/{len} {msg} ({elapsed})")
                .unwrap_or_else(|_| ProgressStyle::default_bar())
                .progress_chars("=> "),
        );
        pb.set_prefix(what.to_owned());
        pb
    }

    /// A fresh, empty directory under the scratch directory.
    pub fn fresh_dir(&self, name: &str) -> std::io::Result<PathBuf> {
        let d = self.scratch.join(name);
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d)?;
        Ok(d)
    }
}

/// `file://` URL of a local directory.
pub fn file_url(dir: &std::path::Path) -> String {
    format!("file://{}", dir.display())
}

/// Total bytes of the files under `dir`.
pub fn dir_bytes(dir: &std::path::Path) -> u64 {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return 0;
    };
    rd.flatten()
        .map(|e| {
            let p = e.path();
            if p.is_dir() {
                dir_bytes(&p)
            } else {
                e.metadata().map(|m| m.len()).unwrap_or(0)
            }
        })
        .sum()
}

/// The median of `a` over `b` (NaN when `a` is missing).
pub(crate) fn ratio(a: Option<&crate::stats::Summary>, b: f64) -> f64 {
    a.map_or(f64::NAN, |s| s.median / b)
}
