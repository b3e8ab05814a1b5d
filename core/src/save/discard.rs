//! Discarding the checkpoints after a step: how a job that went back to an
//! earlier checkpoint (a rollback after a loss spike) makes that checkpoint
//! the newest again, so that it may save the steps after it and a restart
//! resumes from those, not from the run it left.
//!
//! With fencing on, one claim of the next writer epoch is the change
//! ([`crate::layout::epoch::claim_successor`]): it lists the valid
//! checkpoints up to the step only, so the later ones become a fenced
//! writer's at once, on every tier the claim reaches (a tiered store writes
//! claims through to its durable tier). A crash leaves the change whole or
//! absent. Their manifests and data are then deleted, oldest first, and GC
//! sweeps the chunks only they referenced. With fencing off the deletes are
//! the change: oldest first, so until the last one the newest checkpoint is
//! the one it was before.

use object_store::ObjectStoreExt;

use crate::checkpointer::Checkpointer;
use crate::error::{Error, Result};
use crate::layout::catalog;
use crate::layout::paths;
use crate::layout::retention::GcReport;
use crate::model::CheckpointId;

impl Checkpointer {
    /// Discard every committed checkpoint of a step after `step`, so that
    /// `step`'s is the newest: the job may save the steps after it again
    /// (a save of a step before a committed checkpoint's is refused with
    /// [`Error::Conflict`]), and `load_latest` resumes from those saves.
    /// This is how a job rolls back, e.g. to the checkpoint before a loss
    /// spike: load it, discard what came after, train on.
    ///
    /// Waits for this process's saves in flight first. Returns what was
    /// removed: the discarded checkpoints are among
    /// [`GcReport::retired`], with whatever retention retired in the same
    /// round.
    ///
    /// In a job of several ranks, rank 0 discards (it alone publishes and
    /// deletes); other ranks return an empty report at once. Let them save
    /// again only after rank 0 returned.
    ///
    /// Errors: [`Error::InvalidInput`] on a read-only checkpointer, or when
    /// no valid checkpoint of `step` is committed (a mistyped step must not
    /// discard what it names by accident);
    /// [`Error::Fenced`] when a newer incarnation claimed the root (then
    /// nothing is discarded); storage errors.
    ///
    /// ```
    /// # async fn demo(format: std::sync::Arc<dyn ckpt_core::Format>) -> ckpt_core::Result<()> {
    /// use ckpt_core::{Checkpointer, State, Tensor};
    /// let cp = Checkpointer::builder("memory://rollback").format(format).build().await?;
    /// let at = |step: u64| -> ckpt_core::Result<State> {
    ///     Ok(State::new().with_tensor(Tensor::from_f32("w", vec![1], &[step as f32])?))
    /// };
    /// for step in [100, 200, 300] {
    ///     cp.save(step, &at(step)?).await?.wait().await?;
    /// }
    /// // A loss spike after step 100: go back to it.
    /// let loaded = cp.load_step(100).await?;
    /// let report = cp.discard_after(loaded.id.step).await?;
    /// assert_eq!(report.retired.iter().map(|id| id.step).collect::<Vec<_>>(), [200, 300]);
    /// cp.save(110, &at(110)?).await?.wait().await?;
    /// assert_eq!(cp.load_latest().await?.expect("saved").id.step, 110);
    /// # Ok(()) }
    /// ```
    pub async fn discard_after(&self, step: u64) -> Result<GcReport> {
        if self.options().read_only {
            return Err(Error::InvalidInput(format!(
                "cannot discard the checkpoints after step {step}: this checkpointer was opened read-only"
            )));
        }
        self.fencing().check()?;
        if self.rank() != 0 {
            return Ok(GcReport::default());
        }
        self.flush().await;
        let later = {
            let _writes = self.in_flight().collect().await; // no save writes meanwhile
            let committed = self.committed().await?;
            if !committed.iter().any(|id| id.step == step) {
                let steps: Vec<String> = committed.iter().map(|id| id.step.to_string()).collect();
                return Err(Error::InvalidInput(format!(
                    "no committed checkpoint of step {step} to go back to (committed: [{}]); \
                     discard_after takes the step of the checkpoint the job went back to, and \
                     discards nothing else",
                    steps.join(", ")
                )));
            }
            let later: Vec<CheckpointId> =
                committed.into_iter().filter(|id| id.step > step).collect();
            if !later.is_empty() {
                self.remove(step, &later).await?;
            }
            later
        };
        let mut report = self.gc().await?;
        for id in later {
            if !report.retired.contains(&id) {
                report.retired.push(id);
            }
        }
        report.retired.sort();
        Ok(report)
    }

    /// Make `later` (the valid checkpoints after `step`, oldest first) count
    /// no more, then delete their manifests and data.
    async fn remove(&self, step: u64, later: &[CheckpointId]) -> Result<()> {
        let store = self.store().as_ref();
        self.fencing().succeed(store, |id| id.step <= step).await?;
        let mut fence = self.fencing().fence(store).await?;
        for id in later {
            if let Some(f) = fence.as_mut() {
                f.recheck(store).await?;
            }
            match store.delete(&paths::manifest_key(id)).await {
                Ok(()) | Err(object_store::Error::NotFound { .. }) => {}
                Err(e) => return Err(e.into()),
            }
            self.known().remove(id);
            catalog::delete_data(store, id).await?;
            tracing::info!("discarded {id} (after step {step})");
        }
        Ok(())
    }
}
