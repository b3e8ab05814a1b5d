//! What the Python experiment measured.

use serde::Serialize;

use crate::experiments::Target;
use crate::stats::Summary;

/// The machine's floors for the state's bytes (the fastest of their repeats).
#[derive(Debug, Clone, Serialize)]
pub struct PyFloors {
    /// Copy of the state into preallocated buffers, s.
    pub memcpy_s: f64,
    /// Write + fsync of the bytes to one file, s.
    pub write_fsync_s: f64,
    /// Read of that file back, page cache dropped where it could be, s.
    pub read_cold_s: f64,
    /// How the page cache was dropped: `drop_caches`, `fadvise` or `none`.
    pub cache_drop: String,
}

/// One method's saves (and loads, for one method per file format).
#[derive(Debug, Clone, Serialize)]
pub struct PyMethodRow {
    /// Method, e.g. `ckpt eager` or `dcp.async_save`.
    pub name: String,
    /// Why it did not run (it failed to import), if it did not.
    pub skipped: Option<String>,
    /// Time the save call blocked the training loop, s.
    pub stall_s: Option<Summary>,
    /// The stall of a job's first save right after its first step (a new
    /// saver, opened as a job starts), s.
    pub first_stall_s: Option<f64>,
    /// Time until the state may be mutated again, s.
    pub snapshot_s: Option<Summary>,
    /// Time until durable, s.
    pub durable_s: Option<Summary>,
    /// Load into the live model and optimizer, page cache dropped, s (`None`:
    /// the same files and load as another row).
    pub load_s: Option<Summary>,
    /// Bytes written per save (median).
    pub written_bytes: u64,
    /// Peak extra host memory while saving (staging kept between saves counts), bytes.
    pub peak_save_extra_bytes: u64,
    /// Peak extra host memory while loading, bytes.
    pub peak_load_extra_bytes: Option<u64>,
    /// Stall over the memcpy floor.
    pub stall_vs_memcpy: f64,
    /// Time until durable over the write + fsync floor.
    pub durable_vs_write: f64,
    /// Load over the read floor.
    pub load_vs_read: f64,
}

/// One method in the training loop: rounds of `every` steps without
/// checkpointing, then a save and steps until at least `every` are done and the
/// save is durable.
#[derive(Debug, Clone, Serialize)]
pub struct PyLoopRow {
    /// Method checkpointing the loop.
    pub name: String,
    /// Rounds (checkpoints).
    pub rounds: usize,
    /// Time of one step without checkpointing, per round, s.
    pub step_s: Summary,
    /// Steps taken from the save until it was durable (at least `every`), per round.
    pub ckpt_steps: Summary,
    /// Time a checkpoint cost the loop: the part with the save minus as many
    /// steps at the same round's pace without, s.
    pub lost_s: Summary,
    /// `lost_s` over the time of `every` steps without checkpointing: the
    /// slowdown of a loop that checkpoints every `every` steps (fraction).
    pub slowdown: Summary,
    /// Stall of each save in the loop, s.
    pub stall_s: Summary,
    /// Time until durable of each save in the loop, s.
    pub durable_s: Summary,
    /// Time until durable in the loop over the same method's when idle.
    pub durable_vs_idle: Option<f64>,
}

/// Results of the Python experiment.
#[derive(Debug, Clone, Serialize)]
pub struct PyTrainResults {
    /// PyTorch's version.
    pub torch: String,
    /// Which model class.
    pub model: String,
    /// Blocks, width, vocabulary, sequence length, batch.
    pub layers: u64,
    /// Embedding width.
    pub width: u64,
    /// Vocabulary.
    pub vocab: u64,
    /// Tokens per sequence.
    pub seq: u64,
    /// Sequences per step.
    pub batch: u64,
    /// Parameters.
    pub params: u64,
    /// Bytes of model and optimizer state (tied weights once).
    pub state_bytes: u64,
    /// Tensors of model and optimizer state.
    pub tensors: u64,
    /// Timed saves per method.
    pub repeats: usize,
    /// Checkpoints per method in the training loop.
    pub rounds: u64,
    /// Training steps between checkpoints in the loop.
    pub every: u64,
    /// Compute threads of torch, and cores of the machine.
    pub threads: u64,
    /// Cores of the machine.
    pub cores: u64,
    /// Seconds the script ran.
    pub total_s: f64,
    /// The floors.
    pub floors: PyFloors,
    /// One row per method.
    pub methods: Vec<PyMethodRow>,
    /// One row per method in the training loop.
    pub loops: Vec<PyLoopRow>,
    /// The targets, as ratios in the same run.
    pub targets: Vec<Target>,
}
