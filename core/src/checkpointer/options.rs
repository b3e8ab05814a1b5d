//! What a [`Checkpointer`](super::Checkpointer) can be told: [`CheckpointerOptions`] and [`SnapshotMode`].

use std::time::Duration;

use crate::format::WriteOptions;
use crate::layout::retention::Retention;
use crate::staging::BusyPolicy;

/// When the snapshot copy happens.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum SnapshotMode {
    /// `save` returns once every tensor is copied into staging memory.
    #[default]
    Eager,
    /// `save` returns at once; the copy runs in the background, and the caller must
    /// call `wait_snapshot()` on the handle before it mutates the state.
    Lazy,
}

/// Options of a [`Checkpointer`](super::Checkpointer).
#[derive(Debug, Clone)]
pub struct CheckpointerOptions {
    /// How formats write (chunk size, compression, concurrency).
    pub write: WriteOptions,
    /// Which checkpoints to keep; applied after every commit.
    pub retention: Retention,
    /// Staging memory budget in bytes; `None`: twice the first save's copied bytes
    /// (room for one save persisting while the next one snapshots).
    pub staging_budget: Option<u64>,
    /// What to do when the budget is spent.
    pub busy: BusyPolicy,
    /// Eager or lazy snapshot.
    pub snapshot: SnapshotMode,
    /// Threads used by the snapshot copy.
    pub snapshot_threads: usize,
    /// Tensors read at once by a load.
    pub load_concurrency: usize,
    /// How long a rank waits for the others at each collective step of a save
    /// before the save fails with [`Error::Timeout`](crate::Error::Timeout).
    pub collective_timeout: Duration,
    /// Open the root for reading only: `load_latest` never claims a writer
    /// epoch (so a process that only reads, an evaluation job next to the
    /// training, never fences the job that writes), and `save` and `gc` are
    /// refused with [`Error::InvalidInput`](crate::Error::InvalidInput).
    /// In a job of several ranks its one write is a rank's attendance mark
    /// ([`crate::coord::RollCall`]) in a collective that waits long.
    pub read_only: bool,
    /// Claim a writer epoch and fence older incarnations
    /// ([`crate::layout::epoch`]). On by default; off only for a process that
    /// must write under a root without excluding another writer (it then
    /// commits with epoch 0, which a claimed root treats as a zombie's).
    pub fencing: bool,
    /// The fencing lease: an old writer acts at most half of it after its
    /// last check that it is current, and a new epoch's first save waits until
    /// this long after its claim (only when the root had an earlier epoch).
    pub fence_lease: Duration,
    /// GC keeps chunks and incomplete saves' data younger than this (they may
    /// belong to a save in flight in another process).
    pub gc_grace: Duration,
    /// Every this many collections after a commit, a full sweep (listing
    /// `data/` and `chunks/` for what nothing references); the others list
    /// only what is retired. 0: every collection is a full sweep.
    pub gc_sweep_every: u32,
}

impl Default for CheckpointerOptions {
    fn default() -> Self {
        let cores = std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(2);
        CheckpointerOptions {
            write: WriteOptions::default(),
            retention: Retention::keep_all(),
            staging_budget: None,
            busy: BusyPolicy::Wait,
            snapshot: SnapshotMode::Eager,
            snapshot_threads: cores.min(8),
            load_concurrency: 16,
            collective_timeout: Duration::from_secs(600),
            read_only: false,
            fencing: true,
            fence_lease: Duration::from_secs(2),
            gc_grace: Duration::from_secs(60),
            gc_sweep_every: 16,
        }
    }
}
