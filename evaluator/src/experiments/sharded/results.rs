//! What the sharded experiment measured.

use serde::Serialize;

use crate::experiments::Target;
use crate::stats::Summary;

/// The machine's floors for one rank's local bytes, slowest rank.
#[derive(Debug, Clone, Serialize)]
pub struct ShardedFloors {
    /// Write + fsync of the local bytes to one file, s.
    pub write_fsync_s: f64,
    /// Read of that file back, s (cold where the cache could be dropped).
    pub read_cold_s: f64,
    /// Copy of the local state into preallocated buffers, s.
    pub memcpy_s: f64,
    /// How the page cache was dropped: `drop_caches`, `fadvise` or `none`.
    pub cache_drop: String,
}

/// One method on one rank count.
#[derive(Debug, Clone, Serialize)]
pub struct ShardedRow {
    /// Number of ranks.
    pub ranks: usize,
    /// Method, e.g. `ckpt eager` or `dcp.async_save`.
    pub name: String,
    /// Why the method did not run (it failed to import), if it did not.
    pub skipped: Option<String>,
    /// Time the save call blocked the caller, s.
    pub stall_s: Option<Summary>,
    /// Time until the state may be mutated again (staging done), s.
    pub snapshot_s: Option<Summary>,
    /// Time until durable, s.
    pub durable_s: Option<Summary>,
    /// Load into a fresh model and optimizer, page cache dropped, s.
    pub load_s: Option<Summary>,
    /// Bytes written per rank (median).
    pub written_bytes: u64,
    /// Peak extra host memory of a rank and its child processes, bytes.
    pub peak_extra_bytes: u64,
    /// Stall over the memcpy floor.
    pub stall_vs_memcpy: f64,
    /// Time until durable over the write + fsync floor.
    pub durable_vs_write: f64,
    /// Load over the read floor.
    pub load_vs_read: f64,
    /// Bytes written per rank over the rank's local state.
    pub written_vs_local: f64,
    /// Peak extra host memory over the rank's local state.
    pub peak_vs_local: f64,
}

/// One rank count.
#[derive(Debug, Clone, Serialize)]
pub struct ShardedRun {
    /// Number of ranks.
    pub ranks: usize,
    /// Hidden size of the MLP (not divisible by the rank count).
    pub hidden: u64,
    /// Parameter bytes of the whole model.
    pub param_bytes: u64,
    /// Bytes of model and optimizer state on the largest rank.
    pub local_bytes: u64,
    /// The floors.
    pub floors: ShardedFloors,
    /// One row per method.
    pub rows: Vec<ShardedRow>,
}

/// Results of the sharded experiment.
#[derive(Debug, Clone, Serialize)]
pub struct ShardedResults {
    /// PyTorch's version.
    pub torch: String,
    /// Timed repeats per method.
    pub repeats: usize,
    /// One per rank count.
    pub runs: Vec<ShardedRun>,
    /// The targets, as ratios in the same run.
    pub targets: Vec<Target>,
}
