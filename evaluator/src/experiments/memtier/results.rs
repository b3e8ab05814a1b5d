//! What the memory tier's scripts write: `memtier_bench.py` (its restore
//! mode, with the restarts of `memtier_restart.py`) and `memtier_campaign.py`.
//! Field names are the scripts' own.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// Where a restart restores from, as the scripts name it, in the table's order.
pub const SOURCES: [&str; 6] = [
    "memory",
    "peer",
    "memory, fewer ranks",
    "disk cold",
    "s3",
    "torch.load cold",
];

/// The baseline every figure is a ratio to: ckpt on local disk, page cache dropped.
pub const BASELINE: &str = "disk cold";

/// One restart of the job.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RestartRun {
    /// From the failure to the slowest rank's first training step, s.
    pub to_first_step_s: f64,
    /// The slowest rank's restore within it, s.
    pub restore_s: f64,
    /// The slowest rank's start until it was ready to restore (imports,
    /// rendezvous), s.
    pub ready_s: f64,
    /// Where each rank restored from.
    pub sources: Vec<String>,
    /// Every rank's state after the first step equal to the saved one's.
    pub bitwise: bool,
}

/// The restarts by source.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Restarts {
    /// Ranks of the job, one per node.
    pub ranks: usize,
    /// MiB of state per rank.
    pub mib_per_rank: f64,
    /// Restarts per source.
    pub repeats: usize,
    /// How the page cache was dropped (`drop_caches`, `fadvise`, `none`).
    pub page_cache: String,
    /// The sources measured, in order.
    pub sources: Vec<String>,
    /// Each source's restarts.
    pub runs: BTreeMap<String, Vec<RestartRun>>,
}

/// Young/Daly for one source's restart time.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Goodput {
    /// The interval sqrt(2 C M), s.
    pub interval_s: f64,
    /// The fraction of time left for training.
    pub goodput: f64,
}

/// What `memtier_bench.py` writes in its restore mode.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct BenchResults {
    /// GiB of the in-process state (and per rank of the restarted job).
    pub gib: f64,
    /// Repeats of each restore and restart.
    pub repeats: usize,
    /// The restarts by source.
    pub restart: Restarts,
    /// Stalls of saves to the memory tier alone (the first one cold), s.
    pub memory_save_stall_s: Vec<f64>,
    /// Stalls of eager saves (the first one the process's, cold) by where they went:
    /// `memory`, `memory and disk` (one snapshot for both tiers), `disk` (a
    /// plain checkpointer), s. Empty from a script that did not measure them.
    #[serde(default)]
    pub save_stalls_s: BTreeMap<String, Vec<f64>>,
    /// Mean time between failures Young/Daly is given, s.
    pub mtbf_s: f64,
    /// Young/Daly per source.
    pub goodput_young_daly: BTreeMap<String, Goodput>,
    /// How the page cache was dropped for the in-process restores.
    pub page_cache: String,
    /// In-process restores by source (empty lists: not run), s.
    pub seconds: BTreeMap<String, Vec<f64>>,
}

/// One episode of the memory tier's fault campaign.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Episode {
    /// `node` or `rank`.
    pub fault: String,
    /// Steps between the newest any rank logged and the one resumed.
    pub steps_lost: Option<i64>,
    /// Where each rank restored from.
    pub sources: Vec<String>,
    /// Every rank resumed a step it logged, state and generators equal.
    pub bitwise: bool,
    /// From the kill to the slowest rank's first step, s.
    pub restart_to_first_step_s: f64,
    /// The slowest rank's restore, s.
    pub restore_s: f64,
}

/// What `memtier_campaign.py` writes.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct CampaignResults {
    /// Episodes run.
    pub episodes: usize,
    /// Of them, node failures.
    pub node_failures: usize,
    /// Of them, single rank kills.
    pub rank_kills: usize,
    /// Episodes resumed bitwise.
    pub resumed_bitwise: usize,
    /// Episodes that resumed a torn or undetectedly corrupt state.
    pub torn_or_undetected: usize,
    /// Episodes where a rank restored a peer's replica.
    pub from_peer_replicas: usize,
    /// Node failures that every rank of the lost node resumed from a peer's replica.
    #[serde(default)]
    pub node_failures_from_peer: usize,
    /// A save every this many steps.
    #[serde(default)]
    pub save_every: usize,
    /// Each episode.
    pub episodes_detail: Vec<Episode>,
}

/// What `memtier_bench.py --loop` writes: a training loop saving to the
/// memory tier with and without replication to the peer node, alternating.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct LoopResults {
    /// Ranks of the job, one per node.
    pub ranks: usize,
    /// Steps per loop.
    pub steps: usize,
    /// A save every this many steps.
    pub every: usize,
    /// Emulated compute per step, ms.
    pub compute_ms: f64,
    /// How the compute is emulated (`idle host (sleep)`, `busy wait`).
    pub compute: String,
    /// MiB of state per rank.
    pub state_mib: usize,
    /// The slowest rank's loop until its last step, per round, by variant
    /// (`replicated`, `memory only`), s.
    pub seconds: BTreeMap<String, Vec<f64>>,
    /// The slowest rank's wait after its last step for the last save (and
    /// its replication), per round, by variant, s.
    pub final_wait_s: BTreeMap<String, Vec<f64>>,
}

/// What the experiment measured.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct MemtierResults {
    /// The restarts and restores.
    pub bench: BenchResults,
    /// The campaign, when it ran (`--memtier-episodes`, or `--full`).
    pub campaign: Option<CampaignResults>,
    /// The loop with and without replication (absent from older results).
    #[serde(default)]
    pub replication_loop: Option<LoopResults>,
    /// Why S3 is not among the sources, if it is not.
    pub s3_not_run: Option<String>,
}
