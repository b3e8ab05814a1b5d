//! The saves of a checkpointer in flight: which ones, the gate that keeps GC
//! from deleting under them, and the failures of those nobody waited for.

use std::collections::HashSet;
use std::sync::Mutex;

use tokio::sync::{Notify, RwLock, RwLockReadGuard, RwLockWriteGuard};

use crate::error::wire::WireError;
use crate::model::CheckpointId;
use crate::sync::MutexExt;

/// Saves started and not yet committed or failed, shared by the clones of a
/// checkpointer.
#[derive(Debug, Default)]
pub(crate) struct InFlight {
    ids: Mutex<HashSet<CheckpointId>>,
    /// Woken whenever a save ends.
    ended: Notify,
    /// Saves hold it shared while they write; GC takes it exclusively.
    gate: RwLock<()>,
    /// Background failures nobody has seen yet (step, error); the next
    /// `save` reports them.
    unobserved: Mutex<Vec<(u64, WireError)>>,
}

/// GC's hold on the gate: no save writes while it lives.
pub(crate) struct Collecting<'a> {
    _gate: RwLockWriteGuard<'a, ()>,
    /// The saves in flight when GC took the gate: what they wrote must stay.
    pub protected: HashSet<CheckpointId>,
}

impl InFlight {
    /// A save of `id` has started.
    pub fn begin(&self, id: CheckpointId) {
        self.ids.lock_unpoisoned().insert(id);
    }

    /// The save of `id` is committed or failed.
    pub fn finish(&self, id: &CheckpointId) {
        self.ids.lock_unpoisoned().remove(id);
        self.ended.notify_waiters();
    }

    /// Wait until every save started so far has finished.
    pub async fn flush(&self) {
        loop {
            let notified = self.ended.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if self.ids.lock_unpoisoned().is_empty() {
                return;
            }
            notified.await;
        }
    }

    /// A save's hold on the gate while it writes: GC waits for it.
    pub async fn writing(&self) -> RwLockReadGuard<'_, ()> {
        self.gate.read().await
    }

    /// GC's hold on the gate, once no save is writing.
    pub async fn collect(&self) -> Collecting<'_> {
        let gate = self.gate.write().await;
        self.collecting(gate)
    }

    /// GC's hold on the gate, unless a save is writing now.
    pub fn try_collect(&self) -> Option<Collecting<'_>> {
        let gate = self.gate.try_write().ok()?;
        Some(self.collecting(gate))
    }

    fn collecting<'a>(&self, gate: RwLockWriteGuard<'a, ()>) -> Collecting<'a> {
        Collecting {
            _gate: gate,
            protected: self.ids.lock_unpoisoned().clone(),
        }
    }

    /// The save of `step` failed in the background and nobody has seen it yet.
    pub fn failed(&self, step: u64, error: WireError) {
        self.unobserved.lock_unpoisoned().push((step, error));
    }

    /// A background failure nobody has seen yet, if any; it is reported once.
    pub fn take_unobserved(&self) -> Option<(u64, WireError)> {
        self.unobserved.lock_unpoisoned().pop()
    }

    /// The failure of the save of `step` was seen (by `SaveHandle::wait`).
    pub fn observed(&self, step: u64) {
        self.unobserved
            .lock_unpoisoned()
            .retain(|(s, _)| *s != step);
    }
}
