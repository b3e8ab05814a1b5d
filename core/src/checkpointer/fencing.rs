//! This checkpointer's writer epoch ([`crate::layout::epoch`]): its claim,
//! the lease its first save waits out, and whether a newer epoch fenced it.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use object_store::ObjectStore;

use crate::error::{Error, Result};
use crate::layout::epoch::{self, ClaimStrength, Claimed, Fence, ManifestEpochs};
use crate::sync::MutexExt;

/// The fencing state of a checkpointer, shared by its clones.
#[derive(Debug)]
pub(crate) struct Fencing {
    /// Whether this checkpointer claims at all: rank 0 of a writer with
    /// fencing on. Other ranks and read-only checkpointers never claim.
    claims: bool,
    /// The job's nonce, recorded in the claim.
    nonce: String,
    strength: ClaimStrength,
    lease: Duration,
    /// The epoch claimed, on the first `load_latest`, `claim`, commit or GC.
    claimed: tokio::sync::Mutex<Option<Claimed>>,
    /// Set once a commit or GC found this job fenced (its epoch and the
    /// newest): later saves fail at once, writing nothing.
    fenced: Mutex<Option<(u64, u64)>>,
    /// Set once the first save after the claim decided whether to wait out
    /// the lease.
    fenced_in: AtomicBool,
    /// The epochs of the manifests this checkpointer has judged.
    epochs: Arc<ManifestEpochs>,
}

impl Fencing {
    /// Nothing claimed yet. `claims`: whether this checkpointer ever does.
    pub fn new(claims: bool, nonce: String, strength: ClaimStrength, lease: Duration) -> Fencing {
        Fencing {
            claims,
            nonce,
            strength,
            lease,
            claimed: tokio::sync::Mutex::new(None),
            fenced: Mutex::new(None),
            fenced_in: AtomicBool::new(false),
            epochs: Arc::default(),
        }
    }

    /// The epochs of the manifests this checkpointer has judged (listings
    /// and GC read each manifest once for its epoch).
    pub fn manifest_epochs(&self) -> &Arc<ManifestEpochs> {
        &self.epochs
    }

    /// The epoch claimed, claiming the next one of `store` first if none is
    /// yet. `None` when this checkpointer never claims.
    pub async fn claimed(&self, store: &dyn ObjectStore) -> Result<Option<Claimed>> {
        if !self.claims {
            return Ok(None);
        }
        let mut slot = self.claimed.lock().await;
        if slot.is_none() {
            *slot = Some(epoch::claim_next(store, &self.nonce, self.strength).await?);
        }
        Ok(slot.clone())
    }

    /// Claim the epoch after the one held (claiming one first if none is
    /// yet), keeping valid only the checkpoints `keep` accepts
    /// ([`epoch::claim_successor`]), and carry on under it. The lease the
    /// first save waits out still counts from the first claim: the epoch
    /// before is this writer's own. `None` when this checkpointer never claims.
    pub async fn succeed(
        &self,
        store: &dyn ObjectStore,
        keep: impl Fn(&crate::model::CheckpointId) -> bool,
    ) -> Result<Option<u64>> {
        if !self.claims {
            return Ok(None);
        }
        self.check()?;
        let mut slot = self.claimed.lock().await;
        let held = match slot.as_ref() {
            Some(c) => c.clone(),
            None => epoch::claim_next(store, &self.nonce, self.strength).await?,
        };
        let r = epoch::claim_successor(store, &self.nonce, self.strength, held.epoch, keep).await;
        self.note(&r);
        *slot = Some(Claimed {
            epoch: r.as_ref().map_or(held.epoch, |e| *e),
            ..held
        });
        r.map(Some)
    }

    /// The fence a commit or GC checks, claiming first if need be.
    pub async fn fence(&self, store: &dyn ObjectStore) -> Result<Option<Fence>> {
        let claimed = self.claimed(store).await?;
        Ok(claimed.map(|c| Fence::new(c.epoch, self.lease)))
    }

    /// Claim if not yet claimed; on the first save after a claim on a root
    /// with an earlier epoch, how long to wait before writing (the rest of
    /// the lease). Otherwise, and on checkpointers that never claim, `None`.
    pub async fn fence_in(&self, store: &dyn ObjectStore) -> Result<Option<Duration>> {
        let Some(c) = self.claimed(store).await? else {
            return Ok(None);
        };
        if self.fenced_in.swap(true, Ordering::AcqRel) || !c.had_predecessor {
            return Ok(None);
        }
        Ok(Some(self.lease.saturating_sub(c.at.elapsed())))
    }

    /// Remember that this job is fenced, when `r` says so.
    pub fn note<T>(&self, r: &Result<T>) {
        if let Err(Error::Fenced { epoch, current }) = r {
            *self.fenced.lock_unpoisoned() = Some((*epoch, *current));
        }
    }

    /// [`Error::Fenced`] once a commit or GC found this job fenced.
    pub fn check(&self) -> Result<()> {
        match *self.fenced.lock_unpoisoned() {
            Some((epoch, current)) => Err(Error::Fenced { epoch, current }),
            None => Ok(()),
        }
    }
}
