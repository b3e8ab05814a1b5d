//! The [`Checkpointer`]: options, construction, and the state shared by saves and loads.

use std::collections::HashSet;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use object_store::ObjectStore;

use crate::coord::{Coordinator, Solo};
use crate::error::{Error, Result};
use crate::format::{Compression, Format, FormatRegistry, WriteOptions};
use crate::layout::chunks::ChunkIndex;
use crate::layout::epoch::{self, Claimed};
use crate::layout::retention::Retention;
use crate::model::CheckpointId;
use crate::staging::{BusyPolicy, StagingPool};
use crate::store::{self, Capabilities};
use crate::sync::MutexExt;

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

/// Options of a [`Checkpointer`].
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
    /// before the save fails with [`Error::Timeout`].
    pub collective_timeout: Duration,
    /// Open the root for reading only: `load_latest` never claims a writer
    /// epoch (so a process that only reads, an evaluation job next to the
    /// training, never fences the job that writes), and `save` and `gc` are
    /// refused with [`Error::InvalidInput`].
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
        }
    }
}

/// Saves and loads checkpoints under one root (a URL).
///
/// Cheap to clone; clones share the store, the staging pool and the in-flight saves.
#[derive(Debug, Clone)]
pub struct Checkpointer {
    pub(crate) inner: Arc<Shared>,
}

/// What the clones of one [`Checkpointer`] share: the store, the options, the
/// staging pool and the bookkeeping of saves in flight.
#[derive(Debug)]
pub(crate) struct Shared {
    pub url: String,
    pub store: Arc<dyn ObjectStore>,
    /// What the store is good at.
    pub caps: Capabilities,
    pub format: Arc<dyn Format>,
    pub registry: FormatRegistry,
    pub opts: CheckpointerOptions,
    pub chunks: Arc<ChunkIndex>,
    pub pool: Mutex<Option<StagingPool>>,
    /// Saves hold it shared while they write; GC takes it exclusively.
    pub write_gate: Arc<tokio::sync::RwLock<()>>,
    pub inflight: Mutex<HashSet<CheckpointId>>,
    pub inflight_done: tokio::sync::Notify,
    /// Background failures nobody has seen yet; the next `save` reports them.
    pub unobserved: Mutex<Vec<(u64, crate::error::wire::WireError)>>,
    /// Checkpoints a load found damaged: their steps may be saved again.
    pub damaged: Mutex<HashSet<CheckpointId>>,
    /// The committed checkpoints this checkpointer knows of: listed by its
    /// first save (`None` until then, so a checkpointer that only loads never
    /// lists for it), then kept up to date with its own commits and what its
    /// GC retired. `save` checks its step against this set, so starting a save
    /// of a new step reads nothing from storage (on S3 a listing is a round
    /// trip in the stall); the commit checks the store itself before it
    /// publishes, for checkpoints another process committed since.
    pub known: Mutex<Option<HashSet<CheckpointId>>>,
    /// The ranks of the job.
    pub coord: Arc<dyn Coordinator>,
    /// A random value every rank of the job shares (agreed at build time).
    pub nonce: String,
    /// Saves started (that reached the persist phase); every rank counts the same.
    pub seq: AtomicU64,
    /// The sequence number whose turn it is to run the collective part of a save.
    pub turn: tokio::sync::watch::Sender<u64>,
    /// The writer epoch rank 0 claimed (on the first `load_latest`, `claim`
    /// or commit); other ranks never claim.
    pub epoch: tokio::sync::Mutex<Option<Claimed>>,
    /// Set once a commit or GC found this job fenced (its epoch and the
    /// newest): later saves fail at once, writing nothing.
    pub fenced: Mutex<Option<(u64, u64)>>,
    /// Set once the first save of this checkpointer waited out the lease and
    /// rescanned the stored chunks.
    pub fenced_in: std::sync::atomic::AtomicBool,
}

impl Shared {
    /// Change the known-committed set, once the first save has listed it
    /// (before that there is nothing to keep up to date).
    pub fn update_known(&self, f: impl FnOnce(&mut HashSet<CheckpointId>)) {
        if let Some(known) = self.known.lock_unpoisoned().as_mut() {
            f(known);
        }
    }
}

/// Builds a [`Checkpointer`].
#[derive(Debug)]
pub struct CheckpointerBuilder {
    url: String,
    store: Option<Arc<dyn ObjectStore>>,
    caps: Option<Capabilities>,
    format: Option<Arc<dyn Format>>,
    registry: FormatRegistry,
    opts: CheckpointerOptions,
    coord: Arc<dyn Coordinator>,
}

impl Checkpointer {
    /// Start building a checkpointer for a URL (`file:///dir`, `memory://name`, a path).
    pub fn builder(url: impl Into<String>) -> CheckpointerBuilder {
        CheckpointerBuilder {
            url: url.into(),
            store: None,
            caps: None,
            format: None,
            registry: FormatRegistry::new(),
            opts: CheckpointerOptions::default(),
            coord: Arc::new(Solo),
        }
    }

    /// This process's rank in the job.
    pub fn rank(&self) -> usize {
        self.inner.coord.rank()
    }

    /// Number of ranks in the job.
    pub fn world_size(&self) -> usize {
        self.inner.coord.world_size()
    }

    /// The URL this checkpointer was opened on.
    pub fn url(&self) -> &str {
        &self.inner.url
    }

    /// What the store is good at.
    pub fn capabilities(&self) -> Capabilities {
        self.inner.caps
    }

    /// The underlying store.
    pub fn store(&self) -> &Arc<dyn ObjectStore> {
        &self.inner.store
    }

    /// The options.
    pub fn options(&self) -> &CheckpointerOptions {
        &self.inner.opts
    }

    /// The format new checkpoints are written in.
    pub fn format(&self) -> &Arc<dyn Format> {
        &self.inner.format
    }

    /// The staging pool, once the first save sized it.
    pub fn staging(&self) -> Option<StagingPool> {
        self.inner.pool.lock_unpoisoned().clone()
    }

    /// Number of chunks known to be stored.
    pub fn known_chunks(&self) -> usize {
        self.inner.chunks.len()
    }

    /// Claim the next writer epoch of the root for this job, once (rank 0;
    /// other ranks return `None`, as does a checkpointer with fencing off).
    /// `load_latest` and the first commit call it; call it yourself to fence
    /// an old incarnation before anything else.
    ///
    /// Errors: storage errors, [`Error::Conflict`] when other writers keep
    /// winning the claim.
    pub async fn claim(&self) -> Result<Option<u64>> {
        Ok(self.claimed().await?.map(|c| c.epoch))
    }

    /// Remember that this job is fenced, when `r` says so.
    pub(crate) fn note_fenced<T>(&self, r: &Result<T>) {
        if let Err(Error::Fenced { epoch, current }) = r {
            *self.inner.fenced.lock_unpoisoned() = Some((*epoch, *current));
        }
    }

    pub(crate) async fn claimed(&self) -> Result<Option<Claimed>> {
        if self.inner.opts.read_only || !self.inner.opts.fencing || self.rank() != 0 {
            return Ok(None);
        }
        let mut slot = self.inner.epoch.lock().await;
        if slot.is_none() {
            let strength = self.inner.caps.claim_strength();
            *slot = Some(
                epoch::claim_next(self.inner.store.as_ref(), &self.inner.nonce, strength).await?,
            );
        }
        Ok(slot.clone())
    }

    /// Wait until every save started so far is committed or failed.
    pub async fn flush(&self) {
        loop {
            let notified = self.inner.inflight_done.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if self.inner.inflight.lock_unpoisoned().is_empty() {
                return;
            }
            notified.await;
        }
    }
}

impl CheckpointerBuilder {
    /// Format for new checkpoints (required). It is also registered for loading.
    pub fn format(mut self, format: Arc<dyn Format>) -> Self {
        self.registry.register(format.clone());
        self.format = Some(format);
        self
    }

    /// Formats that loads can read (in addition to the write format).
    pub fn readers(mut self, registry: FormatRegistry) -> Self {
        let write = self.format.clone();
        self.registry = registry;
        if let Some(f) = write {
            self.registry.register(f);
        }
        self
    }

    /// Use this store instead of opening the URL (wrappers, tests, custom backends).
    pub fn store(mut self, store: Arc<dyn ObjectStore>) -> Self {
        self.store = Some(store);
        self
    }

    /// What the store is good at. Default: what [`Capabilities::of_url`] says
    /// of the URL when the builder opens it, [`Capabilities::conservative`]
    /// for a store given with [`Self::store`].
    pub fn capabilities(mut self, caps: Capabilities) -> Self {
        self.caps = Some(caps);
        self
    }

    /// Replace all options.
    pub fn options(mut self, opts: CheckpointerOptions) -> Self {
        self.opts = opts;
        self
    }

    /// Set the retention policy.
    pub fn retention(mut self, retention: Retention) -> Self {
        self.opts.retention = retention;
        self
    }

    /// Set compression.
    pub fn compression(mut self, compression: Compression) -> Self {
        self.opts.write.compression = compression;
        self
    }

    /// Set the snapshot mode.
    pub fn snapshot(mut self, mode: SnapshotMode) -> Self {
        self.opts.snapshot = mode;
        self
    }

    /// Set the staging budget in bytes.
    pub fn staging_budget(mut self, bytes: u64) -> Self {
        self.opts.staging_budget = Some(bytes);
        self
    }

    /// Open the root for reading only ([`CheckpointerOptions::read_only`]).
    pub fn read_only(mut self) -> Self {
        self.opts.read_only = true;
        self
    }

    /// Set the busy policy.
    pub fn busy(mut self, policy: BusyPolicy) -> Self {
        self.opts.busy = policy;
        self
    }

    /// Coordinate with the other ranks of a job (default: a job of one process).
    ///
    /// Every rank builds its checkpointer on the same URL and calls `save` for the
    /// same steps in the same order; each writes its share, and rank 0 commits once
    /// every share is durable.
    pub fn coordinator(mut self, coord: Arc<dyn Coordinator>) -> Self {
        self.coord = coord;
        self
    }

    /// Open the store and scan it for existing chunks.
    pub async fn build(self) -> Result<Checkpointer> {
        let format = self.format.ok_or_else(|| {
            Error::InvalidInput("no format chosen (use ckpt_formats::native())".into())
        })?;
        if self.opts.write.chunk_size == 0 || self.opts.write.chunk_size > crate::MAX_CHUNK_BYTES {
            return Err(Error::InvalidInput(format!(
                "chunk size must be between 1 and {} bytes",
                crate::MAX_CHUNK_BYTES
            )));
        }
        if let Compression::Zstd(level) = self.opts.write.compression {
            if !(1..=22).contains(&level) {
                return Err(Error::InvalidInput(format!(
                    "zstd level {level} is not in 1..=22"
                )));
            }
        }
        let (store, default_caps) = match self.store {
            Some(s) => (s, Capabilities::conservative()),
            None => (store::open_url(&self.url)?, Capabilities::of_url(&self.url)),
        };
        let caps = self.caps.unwrap_or(default_caps);
        if self.coord.world_size() > 1 && self.opts.busy == BusyPolicy::Skip {
            return Err(Error::InvalidInput(
                "BusyPolicy::Skip is not available in a job of several ranks: a skip on one rank \
                 would leave the others waiting; use BusyPolicy::Wait"
                    .into(),
            ));
        }
        let chunks = Arc::new(ChunkIndex::scan(store.as_ref()).await?);
        let pool = self.opts.staging_budget.map(StagingPool::new);
        // Every rank derives the same attempt ids from a value rank 0 chooses.
        let nonce = {
            let mine = crate::layout::paths::new_attempt_id().into_bytes();
            let agreed = self
                .coord
                .broadcast(mine, 0, self.opts.collective_timeout)
                .await?;
            String::from_utf8(agreed).map_err(|_| Error::Internal("bad job nonce".into()))?
        };
        Ok(Checkpointer {
            inner: Arc::new(Shared {
                url: self.url,
                store,
                caps,
                format,
                registry: self.registry,
                opts: self.opts,
                chunks,
                pool: Mutex::new(pool),
                write_gate: Arc::new(tokio::sync::RwLock::new(())),
                inflight: Mutex::new(HashSet::new()),
                inflight_done: tokio::sync::Notify::new(),
                unobserved: Mutex::new(Vec::new()),
                damaged: Mutex::new(HashSet::new()),
                known: Mutex::new(None),
                coord: self.coord,
                nonce,
                seq: AtomicU64::new(0),
                turn: tokio::sync::watch::channel(0).0,
                epoch: tokio::sync::Mutex::new(None),
                fenced: Mutex::new(None),
                fenced_in: std::sync::atomic::AtomicBool::new(false),
            }),
        })
    }
}
