//! What a campaign records of each start and run, and the spread of its
//! figures; the report ([`super::report`]) and the restart baseline
//! ([`super::baseline`]) both build on them.

use ckpt_core::store::FaultCounts;
use serde::{Deserialize, Serialize};

use super::inject::Corruption;
use super::plan::Kind;

/// A checkpoint `load_latest` skipped.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Skipped {
    /// Its step.
    pub step: u64,
    /// Its attempt.
    pub attempt: String,
    /// Error class (`corrupt`, `not_found`, ...).
    pub kind: String,
    /// The error.
    pub error: String,
}

/// One start of a job.
#[derive(Debug, Clone, Default, Serialize)]
pub struct StartRecord {
    /// The failure injected into this start, if any.
    pub kind: Option<Kind>,
    /// Its parameters.
    pub detail: String,
    /// Whether the failure happened as planned.
    pub triggered: bool,
    /// This start follows a failure (it is a restart).
    pub restart: bool,
    /// The step the oracle says it must resume from.
    pub expected_resume: Option<u64>,
    /// The step it resumed from.
    pub resumed_from: Option<u64>,
    /// Checkpoints it skipped.
    pub skipped: Vec<Skipped>,
    /// Checkpoints the oracle says it must skip.
    pub expected_skipped: usize,
    /// Spawn to the first new step, ms.
    pub recovery_ms: Option<f64>,
    /// `load_latest`, ms.
    pub load_ms: Option<f64>,
    /// Highest step reached.
    pub reached: u64,
    /// Steps computed here that the next start had to redo.
    pub lost_steps: Option<u64>,
    /// `done`, `sigkill`, `abort`, `exit N`.
    pub ended: String,
    /// A save in flight when it died, and where the death landed.
    pub torn: Option<(u64, String)>,
    /// Saves that failed (step, error).
    pub failed_saves: Vec<(u64, String)>,
    /// Faults the store injected.
    pub store_faults: Option<FaultCounts>,
    /// The loaded checkpoint was torn or damaged.
    pub loaded_damaged: bool,
    /// A zombie episode: manifests the old incarnation committed after it was
    /// fenced, found on the root (stored, never to be loaded).
    pub zombie_manifests: Option<usize>,
}

/// One run: a job from a fresh root to its final state, through its failures.
#[derive(Debug, Clone, Default, Serialize)]
pub struct RunRecord {
    /// Index in the campaign.
    pub index: usize,
    /// `tch`, `mpi-rank`, `mpi-train`.
    pub job: String,
    /// Training seed (tch), ranks (mpi).
    pub detail: String,
    /// Failures injected, by kind.
    pub failures: Vec<Kind>,
    /// Its starts.
    pub starts: Vec<StartRecord>,
    /// Corruptions applied between starts, with how the next start dealt with them.
    pub corruptions: Vec<(Corruption, String)>,
    /// Final state identical to the failure-free run (`None`: not compared).
    pub final_identical: Option<bool>,
    /// Everything that contradicts the guarantees.
    pub problems: Vec<String>,
    /// Wall time of the run, seconds.
    pub seconds: f64,
}

impl RunRecord {
    /// Pass when nothing contradicted the guarantees and the final state matched.
    pub fn passed(&self) -> bool {
        self.problems.is_empty() && self.final_identical != Some(false)
    }
}

/// Median, 95th percentile and maximum of some numbers.
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct Spread {
    /// How many.
    pub n: usize,
    /// Median.
    pub median: f64,
    /// 95th percentile.
    pub p95: f64,
    /// Maximum.
    pub max: f64,
}

impl Spread {
    /// Of `xs`.
    pub fn of(mut xs: Vec<f64>) -> Spread {
        if xs.is_empty() {
            return Spread::default();
        }
        xs.sort_by(|a, b| a.total_cmp(b));
        let at = |q: f64| xs[((xs.len() - 1) as f64 * q).round() as usize];
        Spread {
            n: xs.len(),
            median: at(0.5),
            p95: at(0.95),
            max: xs[xs.len() - 1],
        }
    }

    /// The ratio of the medians, `self / base` (`None` when either is empty or
    /// `base`'s median is not positive).
    pub fn ratio_to(&self, base: &Spread) -> Option<f64> {
        (self.n > 0 && base.n > 0 && base.median > 0.0).then(|| self.median / base.median)
    }
}
