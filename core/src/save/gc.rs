//! Retention and garbage collection: after a commit, when no other save is
//! writing ([`Checkpointer::maybe_gc`]), and on request ([`Checkpointer::gc`]).
//!
//! Saves hold the write gate shared while they write; GC takes it
//! exclusively, so it never deletes a chunk a save in flight has decided to
//! reuse, and spares the data of every save in flight.

use crate::checkpointer::Checkpointer;
use crate::error::{Error, Result};
use crate::layout::epoch::Fence;
use crate::layout::retention::{self, GcReport, Sweep};
use crate::model::CheckpointId;

impl Checkpointer {
    /// A round after a commit is incremental but every `gc_sweep_every`-th
    /// (the last of each run of that many); one on request is a full sweep.
    fn sweep(&self, fence: Option<Fence>, after_commit: bool) -> Sweep {
        let (refs, round) = self.gc_memo();
        let every = u64::from(self.options().gc_sweep_every);
        Sweep {
            grace: self.options().gc_grace,
            fence,
            epochs: self.fencing().manifest_epochs().clone(),
            incremental: after_commit && every > 0 && round % every != every - 1,
            refs: refs.clone(),
        }
    }

    /// Run retention and GC now unless a save is writing (then the next commit does it).
    pub(crate) async fn maybe_gc(
        &self,
        just_committed: &CheckpointId,
        fence: Option<Fence>,
    ) -> Option<GcReport> {
        self.options().retention.keep_last?;
        let mut hold = self.in_flight().try_collect()?;
        hold.protected.insert(just_committed.clone());
        match retention::collect(
            self.store().as_ref(),
            &self.options().retention,
            self.chunks(),
            &hold.protected,
            &mut self.sweep(fence, true),
        )
        .await
        {
            Ok(r) => Some(r),
            Err(e) => {
                tracing::warn!("garbage collection failed (will retry after the next commit): {e}");
                None
            }
        }
    }

    /// Apply retention and delete garbage now, waiting for saves in flight to finish
    /// writing. In a job of several ranks, call it on rank 0 only.
    ///
    /// A writer (fencing on) claims its epoch first if it has not, and fails
    /// with [`Error::Fenced`], deleting nothing more, once a newer epoch has
    /// claimed the root.
    pub async fn gc(&self) -> Result<GcReport> {
        if self.options().read_only {
            return Err(Error::InvalidInput(
                "cannot collect garbage: this checkpointer was opened read-only".into(),
            ));
        }
        let fence = self.fencing().fence(self.store().as_ref()).await?;
        let hold = self.in_flight().collect().await;
        let report = retention::collect(
            self.store().as_ref(),
            &self.options().retention,
            self.chunks(),
            &hold.protected,
            &mut self.sweep(fence, false),
        )
        .await?;
        for id in &report.retired {
            self.known().remove(id);
        }
        Ok(report)
    }
}
