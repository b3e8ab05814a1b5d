//! The [`Checkpointer`]: options, construction, and the state shared by saves and loads.
//!
//! The `impl Checkpointer` blocks of `save/` and `load/` reach that state
//! through the methods here, and its moving parts through small views, each
//! with its own lock and methods:
//!
//! - [`options`]: [`CheckpointerOptions`], [`SnapshotMode`].
//! - [`builder`]: [`CheckpointerBuilder`]: checks the options, opens the store.
//! - [`inflight`]: [`InFlight`]: the saves in flight, the write gate GC
//!   takes, the background failures nobody has seen.
//! - [`known`]: [`Known`]: the committed checkpoints this checkpointer knows
//!   of, and those a load found damaged.
//! - [`turns`]: [`Turns`]: the order of the job's saves, their attempt ids.
//! - [`fencing`]: [`Fencing`]: this writer's epoch, and whether it is fenced.

use std::sync::{Arc, Mutex};

use object_store::ObjectStore;

use crate::coord::Coordinator;
use crate::error::Result;
use crate::format::{Format, FormatRegistry};
use crate::layout::chunks::ChunkIndex;
use crate::layout::epoch::Claimed;
use crate::layout::index::PlanMemo;
use crate::layout::retention::Refs;
use crate::staging::StagingPool;
use crate::store::Capabilities;
use crate::sync::MutexExt;

mod builder;
mod fencing;
mod inflight;
mod known;
mod options;
mod turns;

pub use builder::CheckpointerBuilder;
pub(crate) use fencing::Fencing;
pub(crate) use inflight::InFlight;
pub(crate) use known::Known;
pub use options::{CheckpointerOptions, SnapshotMode};
pub(crate) use turns::Turns;

/// Saves and loads checkpoints under one root (a URL).
///
/// Cheap to clone; clones share the store, the staging pool and the in-flight saves.
#[derive(Debug, Clone)]
pub struct Checkpointer {
    inner: Arc<Shared>,
}

/// What the clones of one [`Checkpointer`] share: what it was built with
/// (fixed), the staging pool, and the views of what changes.
#[derive(Debug)]
struct Shared {
    url: String,
    store: Arc<dyn ObjectStore>,
    /// What the store is good at.
    caps: Capabilities,
    /// The format new checkpoints are written in.
    format: Arc<dyn Format>,
    /// The formats loads can read.
    registry: FormatRegistry,
    opts: CheckpointerOptions,
    /// The chunks known to be stored.
    chunks: Arc<ChunkIndex>,
    /// The ranks of the job.
    coord: Arc<dyn Coordinator>,
    /// `None` until the first save sizes it (unless the options set a budget).
    pool: Mutex<Option<StagingPool>>,
    in_flight: InFlight,
    known: Known,
    turns: Turns,
    fencing: Fencing,
    /// The last save's plan.
    plan_memo: Mutex<PlanMemo>,
    /// What GC read of each checkpoint, and its rounds after commits.
    gc_refs: Arc<Refs>,
    gc_rounds: std::sync::atomic::AtomicU64,
}

impl Checkpointer {
    /// This process's rank in the job.
    pub fn rank(&self) -> usize {
        self.inner.coord.rank()
    }

    /// Number of ranks in the job.
    pub fn world_size(&self) -> usize {
        self.inner.coord.world_size()
    }

    /// Every rank's `data`, in rank order: a collective of the job on the
    /// checkpointer's coordinator, with its `collective_timeout` (ranks that
    /// are not taking part are named, [`Error::Stragglers`], with `phase`).
    /// For steps every rank takes outside the engine (the Python layer's
    /// restore agrees on its outcome with it).
    pub async fn all_gather(&self, data: Vec<u8>, phase: &str) -> Result<Vec<Vec<u8>>> {
        let timeout = self.inner.opts.collective_timeout;
        self.inner
            .coord
            .all_gather(data, timeout)
            .await
            .map_err(|e| e.during(phase))
    }

    /// `root`'s `data` on every rank; as [`Self::all_gather`].
    pub async fn broadcast(&self, data: Vec<u8>, root: usize, phase: &str) -> Result<Vec<u8>> {
        let timeout = self.inner.opts.collective_timeout;
        self.inner
            .coord
            .broadcast(data, root, timeout)
            .await
            .map_err(|e| e.during(phase))
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

    /// Ready the staging memory of a save whose copied tensors have these
    /// byte lengths, before it comes: the buffers are mapped and their pages
    /// faulted in now, so that the save's copy (an eager save's stall, a lazy
    /// one's background) writes into memory that is already there, as every
    /// later save does. The page faults are taken on a blocking thread
    /// within the process's CPU budget ([`crate::budget::run_cpu`]), so at
    /// the background's priority where the runtime lowers it. Best effort
    /// within the staging budget (see [`StagingPool::ready_ahead`]); returns
    /// the bytes readied.
    pub async fn ready_staging(&self, lens: &[usize]) -> Result<u64> {
        let pool = self.staging_for(crate::staging::staged_bytes(lens));
        let lens = lens.to_vec();
        crate::budget::run_cpu(move || pool.ready_ahead(&lens)).await?
    }

    /// Charge `bytes` of host memory the engine does not map (a slab a GPU
    /// copies a snapshot into) to the staging budget, under the busy policy
    /// (see [`StagingPool::charge`]): CPU staging and slabs share one budget.
    /// Also the pool charged, for its [`returns`](StagingPool::returns).
    pub async fn charge_staging(
        &self,
        bytes: u64,
        step: u64,
        since: Option<u64>,
    ) -> Result<(StagingPool, Option<crate::staging::Charge>)> {
        // Whole pages, as the pool counts them (a default budget fits twice).
        let bytes = crate::staging::staged_bytes(&[bytes as usize]);
        let pool = self.staging_for(bytes);
        let charge = pool
            .charge(bytes, self.inner.opts.busy, step, since)
            .await?;
        Ok((pool, charge))
    }

    /// Bytes of staging memory held idle between saves (see [`ready_staging`](Self::ready_staging)).
    pub fn staging_idle_bytes(&self) -> u64 {
        self.staging().map_or(0, |p| p.idle_bytes())
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
    /// Errors: storage errors, [`crate::Error::Conflict`] when other writers
    /// keep winning the claim.
    pub async fn claim(&self) -> Result<Option<u64>> {
        Ok(self.claimed().await?.map(|c| c.epoch))
    }

    /// Wait until every save started so far is committed or failed.
    pub async fn flush(&self) {
        self.inner.in_flight.flush().await
    }

    /// The epoch claimed, claiming it first if need be ([`Fencing::claimed`]).
    pub(crate) async fn claimed(&self) -> Result<Option<Claimed>> {
        self.inner.fencing.claimed(self.inner.store.as_ref()).await
    }

    /// The ranks of the job.
    pub(crate) fn coord(&self) -> &dyn Coordinator {
        self.inner.coord.as_ref()
    }

    /// The chunks known to be stored.
    pub(crate) fn chunks(&self) -> &Arc<ChunkIndex> {
        &self.inner.chunks
    }

    /// The format that wrote a checkpoint, by the name its manifest records.
    pub(crate) fn reader(&self, name: &str) -> Result<Arc<dyn Format>> {
        self.inner.registry.get(name)
    }

    /// The saves in flight.
    pub(crate) fn in_flight(&self) -> &InFlight {
        &self.inner.in_flight
    }

    /// The committed checkpoints known, and the damaged ones.
    pub(crate) fn known(&self) -> &Known {
        &self.inner.known
    }

    /// The order of the job's saves.
    pub(crate) fn turns(&self) -> &Turns {
        &self.inner.turns
    }

    /// What GC read of each checkpoint, and the number of the next round
    /// after a commit (counted here).
    pub(crate) fn gc_memo(&self) -> (&Arc<Refs>, u64) {
        let n = self
            .inner
            .gc_rounds
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        (&self.inner.gc_refs, n)
    }

    /// What the last save's plan was (`save/exchange.rs`).
    pub(crate) fn plan_memo(&self) -> &Mutex<PlanMemo> {
        &self.inner.plan_memo
    }

    /// This writer's epoch.
    pub(crate) fn fencing(&self) -> &Fencing {
        &self.inner.fencing
    }

    /// The staging pool for a save whose buffers take `staged_bytes` of it
    /// ([`crate::staging::staged_bytes`]: whole pages each). With no budget
    /// set, it is sized to twice the largest save seen so far, and replaced by
    /// a larger one when a save outgrows it (a first save before the optimizer
    /// has state is smaller than the ones after). Buffers of a replaced pool
    /// are freed when the saves using them finish.
    pub(crate) fn staging_for(&self, staged_bytes: u64) -> StagingPool {
        let want = staged_bytes.saturating_mul(2).max(64 << 20);
        let mut pool = self.inner.pool.lock_unpoisoned();
        match pool.as_ref() {
            Some(p) if self.inner.opts.staging_budget.is_some() || p.budget() >= staged_bytes => {
                p.clone()
            }
            _ => pool.insert(StagingPool::new(want)).clone(),
        }
    }
}
