//! What a checkpointer knows of the committed checkpoints under its root:
//! those it listed or committed, and those a load found damaged.

use std::collections::HashSet;
use std::sync::Mutex;

use object_store::ObjectStore;

use crate::error::Result;
use crate::layout::catalog;
use crate::model::CheckpointId;
use crate::sync::MutexExt;

/// The committed checkpoints a checkpointer knows of.
///
/// Listed by its first save (not before, so a checkpointer that only loads
/// never lists for it) unless a listing of the checkpoints came first
/// ([`Known::seed`]), then kept up to date with its own commits and what
/// its GC retired. `save` checks its step against this set, so starting a
/// save of a new step reads nothing from storage (on S3 a listing is a round
/// trip in the stall); the commit checks the store itself before it
/// publishes, for checkpoints another process committed since.
#[derive(Debug, Default)]
pub(crate) struct Known {
    /// `None` until the first save lists the store, or a listing seeds it.
    committed: Mutex<Option<HashSet<CheckpointId>>>,
    /// Checkpoints a load found damaged: their steps may be saved again.
    damaged: Mutex<HashSet<CheckpointId>>,
}

impl Known {
    /// The committed checkpoints of `step` known; the first call lists `store`.
    pub async fn at_step(&self, store: &dyn ObjectStore, step: u64) -> Result<Vec<CheckpointId>> {
        let listed = self.committed.lock_unpoisoned().is_some();
        if !listed {
            let ids = catalog::committed(store).await?;
            let mut committed = self.committed.lock_unpoisoned();
            committed.get_or_insert_with(|| ids.into_iter().collect());
        }
        let committed = self.committed.lock_unpoisoned();
        let at_step = committed.iter().flatten().filter(|id| id.step == step);
        Ok(at_step.cloned().collect())
    }

    /// What a listing of the committed checkpoints found, if the store was
    /// not listed for this yet (a load lists before the first save).
    pub fn seed(&self, ids: impl IntoIterator<Item = CheckpointId>) {
        self.committed
            .lock_unpoisoned()
            .get_or_insert_with(|| ids.into_iter().collect());
    }

    /// `id` is committed (once listed; before that there is nothing to keep
    /// up to date).
    pub fn insert(&self, id: CheckpointId) {
        if let Some(committed) = self.committed.lock_unpoisoned().as_mut() {
            committed.insert(id);
        }
    }

    /// `id` commits nothing any more: retired, gone, or damaged.
    pub fn remove(&self, id: &CheckpointId) {
        if let Some(committed) = self.committed.lock_unpoisoned().as_mut() {
            committed.remove(id);
        }
    }

    /// The known committed checkpoints of steps after `step` that no load
    /// found damaged (empty before the store was listed).
    pub fn newer(&self, step: u64) -> Vec<CheckpointId> {
        let damaged = self.damaged.lock_unpoisoned();
        let committed = self.committed.lock_unpoisoned();
        let mut out: Vec<CheckpointId> = committed
            .iter()
            .flatten()
            .filter(|id| id.step > step && !damaged.contains(*id))
            .cloned()
            .collect();
        out.sort_by_key(|id| id.step);
        out
    }

    /// A load found `id` damaged: its step may be saved again.
    pub fn note_damaged(&self, id: &CheckpointId) {
        self.damaged.lock_unpoisoned().insert(id.clone());
    }

    /// Whether a load found `id` damaged.
    pub fn is_damaged(&self, id: &CheckpointId) -> bool {
        self.damaged.lock_unpoisoned().contains(id)
    }
}
