//! The two phases of a save: snapshot (the stall), then persist and commit in the background.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::checkpointer::{Checkpointer, SnapshotMode};
use crate::error::{Error, Result};
use crate::failpoint;
use crate::layout::catalog;
use crate::layout::epoch::{EpochView, Verdict};
use crate::layout::retention::Retention;
use crate::model::CheckpointId;
use crate::save::persist::PersistJob;

use crate::model::tensor::{check_layout, Tensor};
use crate::model::value::Value;
use crate::save::report::SaveReport;
use crate::save::shared::{self, LaterSnapshot, SharedSnapshot};
use crate::save::snapshot::{self, Capture, SnapState};

/// Where a save's snapshot comes from, and whether it is shared.
enum Source {
    /// Its capture, copied by this save.
    Own,
    /// Its capture, copied by this save and handed back for another's.
    Shared,
    /// Another checkpointer's lazy snapshot, once taken (the capture is empty).
    Later(LaterSnapshot),
}

/// A save in progress. Dropping it does not cancel the save.
#[derive(Debug)]
pub struct SaveHandle {
    id: CheckpointId,
    stall: Duration,
    snapshot: watch::Receiver<SnapState>,
    task: JoinHandle<Result<SaveReport>>,
    cp: Checkpointer,
}

impl SaveHandle {
    /// The checkpoint this save will commit.
    pub fn id(&self) -> &CheckpointId {
        &self.id
    }

    /// Time `save` kept the caller waiting.
    pub fn stall(&self) -> Duration {
        self.stall
    }

    /// True once the snapshot is complete and the state may be mutated again.
    pub fn snapshot_done(&self) -> bool {
        !matches!(*self.snapshot.borrow(), SnapState::Pending)
    }

    /// Wait until the snapshot copy is complete; after this the caller may mutate
    /// the captured state. Returns the snapshot's error if it failed.
    pub async fn wait_snapshot(&self) -> Result<()> {
        let mut rx = self.snapshot.clone();
        let state = rx
            .wait_for(|s| !matches!(s, SnapState::Pending))
            .await
            .map_err(|_| Error::Internal("snapshot task vanished".into()))?
            .clone();
        match state {
            SnapState::Failed(e) => Err(e.duplicate()),
            _ => Ok(()),
        }
    }

    /// True once the save is committed or failed.
    pub fn is_finished(&self) -> bool {
        self.task.is_finished()
    }

    /// Wait until the checkpoint is durable and committed, or the save failed.
    pub async fn wait(self) -> Result<SaveReport> {
        let step = self.id.step;
        let out = match self.task.await {
            Ok(r) => r,
            Err(e) => Err(Error::Internal(format!("persist task failed: {e}"))),
        };
        if out.is_err() {
            // Seen here: the next save need not report it again.
            self.cp.in_flight().observed(step);
        }
        out
    }
}

impl Checkpointer {
    /// Save `state` as the checkpoint of `step`.
    ///
    /// Returns once the snapshot is taken (eager mode) or started (lazy mode);
    /// encoding, hashing, writing and the commit continue in the background.
    /// Await [`SaveHandle::wait`] for durability.
    ///
    /// Fails at once with [`Error::Conflict`] if `step` is already committed, with
    /// [`Error::Skipped`] if the staging budget is spent and the policy says skip,
    /// and with the error of an earlier background save that nobody observed.
    pub async fn save(&self, step: u64, state: impl Into<Capture>) -> Result<SaveHandle> {
        Ok(self.save_inner(step, state.into(), Source::Own).await?.0)
    }

    /// [`save`](Self::save), and the snapshot too, for another checkpointer
    /// to save the same snapshot (see [`SharedSnapshot`]): its bytes are this
    /// save's staging copies (or the shared bytes it was given), so that save
    /// copies nothing. In eager mode the tensors ([`SharedSnapshot::Taken`]:
    /// a capture made of them as [`TensorData::Shared`](crate::TensorData::Shared));
    /// in lazy mode, where the snapshot is still being taken when this
    /// returns, a [`LaterSnapshot`] for [`save_snapshot`](Self::save_snapshot).
    /// Holding either keeps this save's staging memory in use.
    pub async fn save_shared(
        &self,
        step: u64,
        state: impl Into<Capture>,
    ) -> Result<(SaveHandle, SharedSnapshot)> {
        let (h, shared) = self.save_inner(step, state.into(), Source::Shared).await?;
        let shared =
            shared.ok_or_else(|| Error::Internal("a shared save shared nothing".into()))?;
        Ok((h, shared))
    }

    /// Save `step` as another checkpointer's lazy save of it
    /// ([`save_shared`](Self::save_shared)) snapshots it: the same tensors,
    /// from its staging copies once they are taken, and `meta`. Returns at
    /// once; the snapshot of this save is done when that one's is, and fails
    /// with its error. The checks of [`save`](Self::save) apply.
    pub async fn save_snapshot(
        &self,
        step: u64,
        meta: Value,
        snapshot: LaterSnapshot,
    ) -> Result<SaveHandle> {
        let capture = Capture {
            tensors: Vec::new(),
            meta,
            ready: None,
        };
        Ok(self
            .save_inner(step, capture, Source::Later(snapshot))
            .await?
            .0)
    }

    async fn save_inner(
        &self,
        step: u64,
        capture: Capture,
        source: Source,
    ) -> Result<(SaveHandle, Option<SharedSnapshot>)> {
        let start = Instant::now();
        if let Some((s, reason)) = self.in_flight().take_unobserved() {
            return Err(
                reason.into_error(&format!("the save of step {s} failed in the background: "))
            );
        }
        let opts = self.options();
        if opts.read_only {
            return Err(Error::InvalidInput(format!(
                "cannot save step {step}: this checkpointer was opened read-only"
            )));
        }
        self.fencing().check()?;
        validate(&capture)?;
        // A step is taken if a readable manifest commits it (see `Checkpointer::
        // conflicting`). Only the checkpoints this checkpointer knows of are
        // checked here, so a new step costs no storage round trip in the stall;
        // the commit checks the store again before it publishes.
        if let Some(existing) = self
            .conflicting(self.known().at_step(self.store().as_ref(), step).await?)
            .await?
        {
            return Err(Error::Conflict(format!(
                "step {step} is already committed ({existing}); a job that went back to an \
                 earlier step discards the checkpoints after it first (discard_after(the step \
                 it went back to))"
            )));
        }
        if let Some(why) = self.before_later(step).await? {
            return Err(Error::Conflict(why));
        }
        failpoint::hit("save.start").await?;

        // Staging memory for the tensors that must be copied.
        let lens = capture.copy_lens();
        let copied_bytes: u64 = lens.iter().map(|&l| l as u64).sum();
        let pool = self.staging_for(crate::staging::staged_bytes(&lens));
        let bufs = pool.acquire(&lens, opts.busy, step).await?;

        // From here on every rank takes part in this save's collectives, even if its
        // own part fails, so that no rank is left waiting.
        let (seq, id) = self.turns().start(step);
        self.in_flight().begin(id.clone());
        let (snap_tx, snap_rx) = watch::channel(SnapState::Pending);
        let threads = opts.snapshot_threads;
        let Capture {
            tensors,
            meta,
            ready,
        } = capture;

        let mut shared = None;
        let (snapshot, eager_error): (JoinHandle<Result<Vec<Tensor>>>, Option<Error>) =
            match (source, opts.snapshot) {
                (Source::Later(later), _) => (
                    tokio::spawn(async move {
                        let t = Instant::now();
                        let r = later.wait().await;
                        let _ = snap_tx.send(match &r {
                            Ok(_) => SnapState::Done(t.elapsed()),
                            Err(e) => SnapState::Failed(Arc::new(e.duplicate())),
                        });
                        r
                    }),
                    None,
                ),
                (source, SnapshotMode::Eager) => {
                    let t = Instant::now();
                    let r = snapshot::wait_and_copy(ready.as_deref(), tensors, bufs, threads);
                    let _ = snap_tx.send(match &r {
                        Ok(_) => SnapState::Done(t.elapsed()),
                        Err(e) => SnapState::Failed(Arc::new(e.duplicate())),
                    });
                    match r {
                        Ok(ts) => {
                            // Clones of the tensors share their bytes.
                            shared = matches!(source, Source::Shared)
                                .then(|| SharedSnapshot::Taken(ts.clone()));
                            (tokio::spawn(async move { Ok(ts) }), None)
                        }
                        Err(e) => {
                            let again = e.duplicate();
                            (tokio::spawn(async move { Err(again) }), Some(e))
                        }
                    }
                }
                (source, SnapshotMode::Lazy) => {
                    // What must not wait for the background (`CopyNow`) is copied in the stall.
                    match snapshot::copy_now_first(tensors, bufs, threads) {
                        Err(e) => {
                            let _ = snap_tx.send(SnapState::Failed(Arc::new(e.duplicate())));
                            let again = e.duplicate();
                            (tokio::spawn(async move { Err(again) }), Some(e))
                        }
                        Ok((tensors, bufs)) => {
                            let mut to_share = None;
                            if matches!(source, Source::Shared) {
                                let (tx, later) = shared::later();
                                shared = Some(SharedSnapshot::Later(later));
                                to_share = Some(tx);
                            }
                            let task = tokio::task::spawn_blocking(move || {
                                let t = Instant::now();
                                let r = snapshot::wait_and_copy(
                                    ready.as_deref(),
                                    tensors,
                                    bufs,
                                    threads,
                                );
                                let _ = snap_tx.send(match &r {
                                    Ok(_) => SnapState::Done(t.elapsed()),
                                    Err(e) => SnapState::Failed(Arc::new(e.duplicate())),
                                });
                                if let Some(tx) = to_share {
                                    tx.send(&r);
                                }
                                r
                            });
                            (task, None)
                        }
                    }
                }
            };
        let stall = start.elapsed();
        let observed = eager_error.is_some();

        let task = {
            let this = self.clone();
            let id = id.clone();
            let snap_rx = snap_rx.clone();
            tokio::spawn(async move {
                let job = PersistJob {
                    id: id.clone(),
                    seq,
                    snapshot,
                    snap_rx,
                    meta,
                    start,
                    stall,
                    copied_bytes,
                };
                let r = this.persist(job).await;
                if let Err(e) = &r {
                    tracing::warn!("save of {id} failed: {e}");
                    if !observed {
                        this.in_flight()
                            .failed(id.step, crate::error::wire::WireError::from(e));
                    }
                }
                this.in_flight().finish(&id);
                r
            })
        };
        if let Some(e) = eager_error {
            return Err(e);
        }
        let handle = SaveHandle {
            id,
            stall,
            snapshot: snap_rx,
            task,
            cp: self.clone(),
        };
        Ok((handle, shared))
    }

    /// Why a save of `step` is refused for coming before committed
    /// checkpoints of later steps, if it is (see [`before_later_reason`]).
    /// The known checkpoints decide, so a save of a new step reads nothing;
    /// only where they would refuse it are their manifests read, so that
    /// those a load found damaged, a zombie committed, or another process
    /// retired or discarded do not count.
    async fn before_later(&self, step: u64) -> Result<Option<String>> {
        let newer = self.known().newer(step);
        if newer.is_empty() {
            return Ok(None);
        }
        let counted = self.committing(newer, usize::MAX).await?;
        Ok(before_later_reason(
            &self.options().retention,
            step,
            &counted,
        ))
    }

    /// The first of `ids` (checkpoints of one step) that commits its step
    /// (see [`Self::committing`]).
    pub(crate) async fn conflicting(&self, ids: Vec<CheckpointId>) -> Result<Option<CheckpointId>> {
        Ok(self.committing(ids, 1).await?.pop())
    }

    /// Those of `ids` that commit their step, in order, up to `limit` of
    /// them: a readable manifest that no load of this checkpointer found
    /// damaged (a torn manifest, on a store that does not write objects
    /// whole, commits nothing, and a job that fell back past a damaged
    /// checkpoint redoes its step beside it), and not a zombie's.
    async fn committing(&self, ids: Vec<CheckpointId>, limit: usize) -> Result<Vec<CheckpointId>> {
        let store = self.store().as_ref();
        let mut view = None;
        let mut out = Vec::new();
        for id in ids {
            if out.len() >= limit {
                break;
            }
            if self.known().is_damaged(&id) {
                continue;
            }
            match catalog::read_manifest(store, &id).await {
                Ok(m) => {
                    // A zombie's checkpoint (committed by a fenced writer) does not count.
                    if view.is_none() {
                        view = Some(EpochView::read(store).await?);
                    }
                    if view
                        .as_ref()
                        .is_some_and(|v| v.judge(&id, m.epoch) == Verdict::Zombie)
                    {
                        // A zombie stays one (a newer claim lists only valid
                        // checkpoints): no need to read it again.
                        self.known().remove(&id);
                        continue;
                    }
                    out.push(id);
                }
                // Gone (retired by another process) or damaged: it commits nothing.
                Err(e) if e.is_damage() => self.known().remove(&id),
                Err(e) => return Err(e),
            }
        }
        Ok(out)
    }
}

fn validate(capture: &Capture) -> Result<()> {
    // A name is one whole tensor, or several pieces of one sharded tensor at
    // distinct offsets (a DTensor whose local shard is not one box).
    let mut names: HashMap<&str, Option<&[u64]>> = HashMap::with_capacity(capture.tensors.len());
    let mut pieces = HashSet::new();
    for t in &capture.tensors {
        check_layout(&t.name, t.dtype, &t.shape, t.shard.as_ref(), t.data.len())?;
        let global = t.shard.as_ref().map(|s| s.global_shape.as_slice());
        let fresh = match names.insert(t.name.as_str(), global) {
            None => true,
            Some(prev) => prev.is_some() && prev == global,
        };
        let distinct = t
            .shard
            .as_ref()
            .is_none_or(|s| pieces.insert((t.name.as_str(), s.offsets.clone())));
        if !fresh || !distinct {
            return Err(Error::InvalidInput(format!(
                "duplicate tensor name `{}`",
                t.name
            )));
        }
    }
    Ok(())
}

/// Why a save of `step` is refused, if it is: `newer` (the committed
/// checkpoints of later steps, oldest first) is not empty. `load_latest`
/// resumes from the newest step, so such a save would never be resumed
/// from: a restart would go back to the run the job left (after a rollback,
/// or a restart that did not load), and with `keep_last` the commit's own GC
/// could retire the save at once. [`Checkpointer::discard_after`] makes the
/// step the job went back to the newest again.
fn before_later_reason(retention: &Retention, step: u64, newer: &[CheckpointId]) -> Option<String> {
    let newest = newer.last()?;
    let shown: Vec<String> = newer
        .iter()
        .rev()
        .take(3)
        .map(|id| id.step.to_string())
        .collect();
    let more = if newer.len() > 3 { ", ..." } else { "" };
    let retired = match retention.keep_last {
        Some(n) if newer.len() >= n.max(1) && !retention.archives(step) => format!(
            " (and retention, keeping the newest {}, would retire it as soon as it commits)",
            n.max(1)
        ),
        _ => String::new(),
    };
    Some(format!(
        "step {step} comes before {} committed checkpoint(s) of later steps ({}{more}): \
         load_latest resumes from the newest, step {}, so a restart would not come back to \
         this save{retired}. A job that went back to an earlier step discards the later \
         checkpoints first (discard_after(the step it went back to)); a new run saves to \
         another root",
        newer.len(),
        shown.join(", "),
        newest.step,
    ))
}
