//! The [`Checkpointer`]: options, construction, and the state shared by saves and loads.
//!
//! - [`options`]: [`CheckpointerOptions`], [`SnapshotMode`].
//! - [`builder`]: [`CheckpointerBuilder`]: checks the options, opens the store.

use std::collections::HashSet;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};

use object_store::ObjectStore;

use crate::coord::Coordinator;
use crate::error::{Error, Result};
use crate::format::{Format, FormatRegistry};
use crate::layout::chunks::ChunkIndex;
use crate::layout::epoch::{self, Claimed};
use crate::model::CheckpointId;
use crate::staging::StagingPool;
use crate::store::Capabilities;
use crate::sync::MutexExt;

mod builder;
mod options;

pub use builder::CheckpointerBuilder;
pub use options::{CheckpointerOptions, SnapshotMode};

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

impl Checkpointer {
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
