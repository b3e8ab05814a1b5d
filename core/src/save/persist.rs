//! The background half of a save: plan, write, and the coordinated commit.
//!
//! ```text
//!  every rank                          rank 0
//!  ──────────                          ──────
//!  wait for its turn (saves in order)
//!  all_gather(plan message)  ───────►  same plan computed everywhere
//!  write its share (format)
//!  all_gather(records or error) ────►  all ok? manifest (data first, manifest last)
//!                                       retention + GC
//!  broadcast(outcome)  ◄────────────── outcome
//! ```
//!
//! Every rank takes part in every step, even after its own part failed (it sends
//! the error instead), so no rank waits for one that gave up; a rank that died
//! makes the others fail at the next step's deadline. In a job of one process the
//! collectives are trivial and the same code runs.
//!
//! A failed save removes none of what it wrote: without a manifest it does not
//! exist for loads, and GC removes its objects later (the GC after a later
//! commit, or [`Checkpointer::gc`]): its `data/` objects once a checkpoint of
//! the same or a later step is committed (saves in flight are protected), its
//! chunks once no kept manifest references them.

use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::checkpointer::Checkpointer;
use crate::coord::Coordinator;
use crate::error::wire::WireError;
use crate::error::{Error, Result};
use crate::failpoint;
use crate::format::{WriteContext, WriteOutput, WriteStats};
use crate::layout::catalog;
use crate::layout::manifest::{Layout, Manifest, TensorRecord, MANIFEST_VERSION};
use crate::layout::paths;
use crate::layout::retention::GcReport;
use crate::model::tensor::Tensor;
use crate::model::value::Value;
use crate::model::CheckpointId;
use crate::save::plan::{self, Holding};
use crate::save::report::SaveReport;
use crate::save::snapshot::SnapState;

/// Everything the persist task needs from `save`.
pub(crate) struct PersistJob {
    pub id: CheckpointId,
    pub seq: u64,
    pub snapshot: JoinHandle<Result<Vec<Tensor>>>,
    pub snap_rx: watch::Receiver<SnapState>,
    pub meta: Value,
    pub start: Instant,
    pub stall: Duration,
    pub copied_bytes: u64,
}

#[derive(Debug, Serialize, Deserialize)]
struct PlanMsg {
    step: u64,
    attempt: String,
    holdings: std::result::Result<Vec<Holding>, WireError>,
    /// Rank 0, on the first save after it claimed an epoch of a root that had
    /// an earlier one: how long every rank waits before it writes (the rest of
    /// the fencing lease), after which every rank lists the stored chunks again.
    #[serde(default)]
    fence_in_ms: Option<u64>,
    /// A digest of this rank's metadata. Only rank 0's reaches the manifest,
    /// and every rank loads it, so another rank's that differs would be lost
    /// without a word (a rank's own values, another tree of tensor names):
    /// the save fails on every rank instead.
    #[serde(default)]
    meta_digest: Option<String>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
struct Share {
    records: Vec<TensorRecord>,
    objects: Vec<String>,
}

/// What rank 0 broadcasts after the commit.
#[derive(Debug, Serialize, Deserialize)]
struct CommitOutcome {
    /// The commit's failure, and the rank it happened on.
    result: std::result::Result<(), (usize, WireError)>,
    deleted_chunks: Vec<String>,
    gc: Option<GcSummary>,
    /// A checkpoint of this step that another writer committed meanwhile
    /// (the commit was refused for it): every rank learns it is committed.
    #[serde(default)]
    committed_by_other: Option<(u64, String)>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
struct GcSummary {
    retired: Vec<(u64, String)>,
    incomplete_removed: Vec<(u64, String)>,
    chunks_deleted: u64,
    chunk_sweep_skipped: bool,
}

/// A digest of a rank's metadata, to compare across ranks (`PlanMsg::meta_digest`).
fn meta_digest(meta: &Value) -> String {
    // Encoded straight into the hasher, without a buffer of the encoding.
    let mut hasher = blake3::Hasher::new();
    match serde_json::to_writer(&mut hasher, meta) {
        Ok(()) => hasher.finalize().to_hex().to_string(),
        // Not encodable: the commit reports it; nothing to compare.
        Err(_) => String::new(),
    }
}

/// The ranks whose metadata digest differs from rank 0's, if any (ranks that
/// sent none, being older or alone, are not compared).
fn differing_meta(plans: &[PlanMsg]) -> Option<Vec<usize>> {
    let first = plans.first()?.meta_digest.as_deref()?;
    let ranks: Vec<usize> = plans
        .iter()
        .enumerate()
        .skip(1)
        .filter(|(_, m)| m.meta_digest.as_deref().is_some_and(|d| d != first))
        .map(|(r, _)| r)
        .collect();
    (!ranks.is_empty()).then_some(ranks)
}

async fn gather_json<T: Serialize + DeserializeOwned>(
    coord: &dyn Coordinator,
    msg: &T,
    timeout: Duration,
    what: &str,
) -> Result<Vec<T>> {
    let bytes = serde_json::to_vec(msg).map_err(|e| Error::Internal(format!("{what}: {e}")))?;
    let all = coord.all_gather(bytes, timeout).await?;
    all.iter()
        .map(|b| {
            serde_json::from_slice(b)
                .map_err(|e| Error::Internal(format!("{what}: bad message: {e}")))
        })
        .collect()
}

impl Checkpointer {
    pub(crate) async fn persist(&self, job: PersistJob) -> Result<SaveReport> {
        let local = match job.snapshot.await {
            Ok(r) => r,
            Err(e) => Err(Error::Internal(format!("snapshot task: {e}"))),
        };
        let snap_time = match *job.snap_rx.borrow() {
            SnapState::Done(d) => d,
            _ => Duration::ZERO,
        };
        let _turn = self.turns().take(job.seq).await;
        let persist_start = Instant::now();
        let coord = self.coord();
        let rank = coord.rank();
        let timeout = self.options().collective_timeout;
        let id = job.id;
        // Rank 0 claims its epoch at the first commit unless a load claimed it;
        // a failed claim fails the save on every rank, as its snapshot would.
        let (local, fence_in_ms) = match self.fencing().fence_in(self.store().as_ref()).await {
            Ok(wait) => (local, wait.map(|d| d.as_millis() as u64)),
            Err(e) => (local.and(Err(e)), None),
        };

        // 1. Plan: who writes what.
        let msg = PlanMsg {
            step: id.step,
            attempt: id.attempt.clone(),
            holdings: local
                .as_ref()
                .map(|ts| {
                    ts.iter()
                        .map(|t| Holding {
                            name: t.name.clone(),
                            bytes: t.data.len() as u64,
                            sharded: t.shard.is_some(),
                            offsets: t.shard.as_ref().map(|s| s.offsets.clone()),
                        })
                        .collect()
                })
                .map_err(WireError::from),
            fence_in_ms,
            meta_digest: (coord.world_size() > 1).then(|| meta_digest(&job.meta)),
        };
        let plans = gather_json(coord, &msg, timeout, "plan").await?;
        let fence_in = plans.first().and_then(|m| m.fence_in_ms);
        let meta_mismatch = differing_meta(&plans);
        let mut holdings = Vec::with_capacity(plans.len());
        let mut failed = None;
        for (r, m) in plans.into_iter().enumerate() {
            if m.step != id.step || m.attempt != id.attempt {
                return Err(Error::Internal(format!(
                    "ranks disagree on the save: rank {r} is at step {} (attempt {}), this rank at {id}; \
                     every rank must call save for the same steps in the same order",
                    m.step, m.attempt
                )));
            }
            match m.holdings {
                Ok(h) => holdings.push(h),
                Err(e) => {
                    failed.get_or_insert((r, e));
                }
            }
        }
        // A rank that could not snapshot fails the save on every rank, as the
        // same error: its own, or the first failing rank's rebuilt.
        let tensors = local?;
        if let Some((r, e)) = failed {
            return Err(e.into_error(&format!("rank {r} could not snapshot: ")));
        }
        if let Some(ranks) = meta_mismatch {
            return Err(Error::InvalidInput(format!(
                "step {}: the metadata of rank(s) {ranks:?} differs from rank 0's; a checkpoint \
                 stores rank 0's alone and every rank loads it, so every rank must save the same \
                 metadata (the same tree of names and plain values); keep a rank's own data in \
                 tensors of names of its own",
                id.step
            )));
        }
        if let Some(ms) = fence_in {
            // An older writer deletes nothing later than half a lease after it
            // last saw itself current, which was before the claim: after the
            // lease, what is listed stays.
            tokio::time::sleep(Duration::from_millis(ms)).await;
            self.chunks().refresh(self.store().as_ref()).await?;
        }
        let plan = plan::make(&holdings)?;
        let mine: Vec<Tensor> = tensors
            .into_iter()
            .filter(|t| {
                let offsets = t.shard.as_ref().map(|s| s.offsets.as_slice());
                plan.writes(rank, &t.name, t.shard.is_some(), offsets)
            })
            .collect();
        let raw_bytes: u64 = mine.iter().map(|t| t.data.len() as u64).sum();

        // 2. Write this rank's share.
        let stats = std::sync::Arc::new(WriteStats::default());
        let written: Result<WriteOutput> = async {
            let _gate = self.in_flight().writing().await;
            failpoint::hit("save.before_data").await?;
            let ctx = self.write_context(&id, &job.meta, stats.clone());
            let out = self.format().write(&ctx, &mine).await?;
            failpoint::hit("save.after_data").await?;
            Ok(out)
        }
        .await;
        drop(mine); // staging buffers go back to the pool
        let share = written
            .as_ref()
            .map(|o| Share {
                records: o.records.clone(),
                objects: o.objects.clone(),
            })
            .map_err(WireError::from);
        let shares = gather_json(coord, &share, timeout, "commit").await?;

        // 3. Rank 0 commits; everyone learns the outcome.
        let mut commit = Duration::ZERO;
        let outcome = if rank == 0 {
            let t = Instant::now();
            let ctx = self.write_context(&id, &job.meta, stats.clone());
            let o = self.commit(&ctx, &id, &shares, job.meta).await;
            commit = t.elapsed();
            o
        } else {
            CommitOutcome {
                result: Ok(()),
                deleted_chunks: Vec::new(),
                gc: None,
                committed_by_other: None,
            }
        };
        let outcome_bytes =
            serde_json::to_vec(&outcome).map_err(|e| Error::Internal(e.to_string()))?;
        let outcome: CommitOutcome =
            serde_json::from_slice(&coord.broadcast(outcome_bytes, 0, timeout).await?)
                .map_err(|e| Error::Internal(format!("outcome: bad message: {e}")))?;
        if let Some((step, attempt)) = outcome.committed_by_other {
            self.known().insert(CheckpointId { step, attempt });
        }
        if let Err((r, e)) = outcome.result {
            // The rank whose write failed reports its own error; the others the same variant.
            written?;
            let context = if r == rank {
                String::new()
            } else {
                format!("rank {r}: ")
            };
            let e = Err(e.into_error(&context));
            self.fencing().note(&e);
            return e;
        }
        written?;

        // Every rank now knows the checkpoint is committed, what GC retired,
        // every chunk of the checkpoint, and what GC deleted.
        self.known().insert(id.clone());
        for (step, attempt) in outcome.gc.iter().flat_map(|g| &g.retired) {
            self.known().remove(&CheckpointId {
                step: *step,
                attempt: attempt.clone(),
            });
        }
        for share in shares.iter().flatten() {
            for r in &share.records {
                if let Layout::Chunks { chunks } = &r.layout {
                    for c in chunks {
                        self.chunks().insert(c.hash.clone(), c.stored);
                    }
                }
            }
        }
        for h in &outcome.deleted_chunks {
            self.chunks().remove(h);
        }
        let written = stats.totals();
        Ok(SaveReport {
            id,
            stall: job.stall,
            snapshot: snap_time,
            persist: persist_start.elapsed(),
            commit,
            total: job.start.elapsed(),
            hash_cpu: written.hash,
            encode_cpu: written.encode,
            write_io: written.write,
            raw_bytes,
            copied_bytes: job.copied_bytes,
            stored_bytes: written.stored_bytes,
            reused_bytes: written.reused_bytes,
            objects: written.objects + u64::from(rank == 0),
            gc: outcome.gc.map(|g| GcReport {
                retired: g
                    .retired
                    .into_iter()
                    .map(|(step, attempt)| CheckpointId { step, attempt })
                    .collect(),
                incomplete_removed: g
                    .incomplete_removed
                    .into_iter()
                    .map(|(step, attempt)| CheckpointId { step, attempt })
                    .collect(),
                chunks_deleted: g.chunks_deleted,
                chunk_sweep_skipped: g.chunk_sweep_skipped,
                deleted_chunks: outcome.deleted_chunks.clone(),
            }),
        })
    }

    /// What the format writes this save's share with.
    fn write_context(
        &self,
        id: &CheckpointId,
        meta: &Value,
        stats: std::sync::Arc<WriteStats>,
    ) -> WriteContext {
        WriteContext {
            store: self.store().clone(),
            data_prefix: paths::data_prefix(id),
            rank: self.rank(),
            world_size: self.world_size(),
            meta: meta.clone(),
            options: self.options().write.clone(),
            chunks: self.chunks().clone(),
            stats,
        }
    }

    /// Rank 0: publish the manifest if every share is in, then retention and GC.
    async fn commit(
        &self,
        ctx: &WriteContext,
        id: &CheckpointId,
        shares: &[std::result::Result<Share, WireError>],
        meta: Value,
    ) -> CommitOutcome {
        let fail = |r: usize, e: WireError| CommitOutcome {
            result: Err((r, e)),
            deleted_chunks: Vec::new(),
            gc: None,
            committed_by_other: None,
        };
        let mut tensors = Vec::new();
        let mut objects = Vec::new();
        for (r, s) in shares.iter().enumerate() {
            match s {
                Ok(s) => {
                    tensors.extend(s.records.iter().cloned());
                    objects.extend(s.objects.iter().cloned());
                }
                Err(e) => return fail(r, e.clone()),
            }
        }
        // `save` checked the step against the checkpoints this checkpointer
        // knows of; another process may have committed it since.
        let others = async {
            let ids = catalog::committed_at(self.store().as_ref(), id.step).await?;
            self.conflicting(ids).await
        };
        match others.await {
            Ok(None) => {}
            Ok(Some(existing)) => {
                let e = Error::Conflict(format!(
                    "step {} was committed by another save ({existing}) while this one ran; \
                     nothing of this one was published",
                    id.step
                ));
                return CommitOutcome {
                    committed_by_other: Some((existing.step, existing.attempt)),
                    ..fail(0, WireError::from(&e))
                };
            }
            Err(e) => return fail(0, WireError::from(&e)),
        }
        match self.format().finish(ctx, &tensors).await {
            Ok(extra) => objects.extend(extra),
            Err(e) => return fail(0, WireError::from(&e)),
        }
        let mut fence = match self.fencing().fence(self.store().as_ref()).await {
            Ok(f) => f,
            Err(e) => return fail(0, WireError::from(&e)),
        };
        let manifest = Manifest {
            version: MANIFEST_VERSION,
            library: concat!("ckpt ", env!("CARGO_PKG_VERSION")).to_owned(),
            format: self.format().name().to_owned(),
            step: id.step,
            attempt: id.attempt.clone(),
            world_size: ctx.world_size as u32,
            created_unix_ms: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .unwrap_or_default()
                .as_millis() as u64,
            epoch: fence.as_ref().map_or(0, |f| f.epoch),
            tensors,
            meta,
            objects,
        };
        let store = self.store().as_ref();
        let published = async {
            if let Some(f) = fence.as_mut() {
                f.check(store).await?;
            }
            failpoint::hit("save.before_manifest").await?;
            catalog::publish_manifest(store, &manifest).await?;
            failpoint::hit("save.after_manifest").await?;
            if let Some(f) = fence.as_mut() {
                f.confirm(store, id).await?;
            }
            Ok::<_, Error>(())
        }
        .await;
        if let Err(e) = published {
            return fail(0, WireError::from(&e));
        }
        let gc = self.maybe_gc(id, fence).await;
        CommitOutcome {
            result: Ok(()),
            committed_by_other: None,
            deleted_chunks: gc
                .as_ref()
                .map(|g| g.deleted_chunks.clone())
                .unwrap_or_default(),
            gc: gc.map(|g| GcSummary {
                retired: g.retired.into_iter().map(|i| (i.step, i.attempt)).collect(),
                incomplete_removed: g
                    .incomplete_removed
                    .into_iter()
                    .map(|i| (i.step, i.attempt))
                    .collect(),
                chunks_deleted: g.chunks_deleted,
                chunk_sweep_skipped: g.chunk_sweep_skipped,
            }),
        }
    }
}
