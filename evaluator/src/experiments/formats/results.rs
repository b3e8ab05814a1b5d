//! What the formats experiment measured.

use serde::Serialize;

use crate::experiments::Target;
use crate::stats::Summary;

/// One way to save, measured.
#[derive(Debug, Clone, Serialize)]
pub struct FormatRow {
    /// Display name, e.g. `ckpt native zstd-3` or `torch.save`.
    pub name: String,
    /// `ckpt` or `python`.
    pub by: String,
    /// Time until durable, seconds.
    pub save_s: Summary,
    /// Time the caller was blocked, seconds.
    pub stall_s: Summary,
    /// Load time (page cache dropped where possible), seconds.
    pub load_s: Summary,
    /// Load time into the caller's buffers (`load_into`, page cache dropped),
    /// seconds; ckpt only.
    pub load_into_s: Option<Summary>,
    /// Bytes on disk.
    pub bytes: u64,
    /// Raw state bytes over save time, GB/s.
    pub save_gbps: f64,
    /// Raw state bytes over load time, GB/s.
    pub load_gbps: f64,
    /// Save time over the raw write + fsync floor.
    pub save_vs_floor: f64,
    /// Load time over the cold read floor.
    pub load_vs_floor: f64,
    /// `load_into` time over the cold read floor; ckpt only.
    pub load_into_vs_floor: Option<f64>,
}

/// Results of the formats experiment.
#[derive(Debug, Clone, Serialize)]
pub struct FormatResults {
    /// Raw bytes of the state.
    pub state_bytes: u64,
    /// Number of tensors.
    pub tensors: usize,
    /// One row per way to save.
    pub rows: Vec<FormatRow>,
    /// Why the Python baselines are missing, if they are.
    pub python_error: Option<String>,
    /// The native format's targets against the floors of the same run.
    pub targets: Vec<Target>,
}
