//! The background half of a save: plan, write, and the coordinated commit.
//!
//! ```text
//!  every rank                          rank 0
//!  ──────────                          ──────
//!  wait for its turn (saves in order)
//!  agree on the plan (exchange.rs) ──►  digests; tables only when new
//!  write its share (format), then its
//!  records as a fragment (2+ ranks)
//!  gather(fragment ref or error) ───►  all ok? root manifest last
//!                                       retention + GC
//!  broadcast(outcome)  ◄────────────── outcome
//! ```
//!
//! No rank but rank 0 receives more as the job grows; rank 0 receives one
//! fragment reference (rank, hash, length) per rank.
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

use serde::{Deserialize, Serialize};
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::checkpointer::Checkpointer;
use crate::error::wire::WireError;
use crate::error::{Error, Result};
use crate::failpoint;
use crate::format::{WriteContext, WriteOutput, WriteStats};
use crate::layout::catalog;
use crate::layout::fragment::{self, Fragment, FragmentRef, FRAGMENT_VERSION};
use crate::layout::index::{self, IndexEntry};
use crate::layout::manifest::{
    Layout, Manifest, TensorRecord, MANIFEST_VERSION, MANIFEST_VERSION_INLINE,
};
use crate::layout::paths;
use crate::layout::retention::GcReport;
use crate::model::tensor::Tensor;
use crate::model::value::Value;
use crate::model::CheckpointId;
use crate::save::report::SaveReport;
use crate::save::snapshot::SnapState;
use crate::save::{exchange, plan};

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

/// What a rank sends rank 0 once it wrote its share.
#[derive(Debug, Clone, Serialize, Deserialize)]
enum Share {
    /// The records themselves (a job of one rank: the manifest holds them).
    Inline {
        records: Vec<TensorRecord>,
        objects: Vec<String>,
    },
    /// Where they are (a job of several ranks), and the records of the
    /// replicated tensors this rank wrote, which the root holds
    /// ([`index::in_root`]).
    Fragment {
        fragment: FragmentRef,
        replicas: Vec<TensorRecord>,
    },
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
    /// A full sweep: every rank forgets the chunks it knew (what GC deleted
    /// is not sent: it grows with the job).
    #[serde(default)]
    full_sweep: bool,
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
        let world = coord.world_size();
        let table = local.as_ref().map(|ts| index::table_of(ts, rank, world));
        let same = local
            .as_ref()
            .ok()
            .filter(|_| world > 1)
            .map(|ts| exchange::fingerprint(ts, rank, world));
        let agreed = self
            .agree_plan(
                &id,
                table.as_ref().map_err(|e| *e),
                (world > 1).then(|| meta_digest(&job.meta)),
                same.as_ref(),
                fence_in_ms,
            )
            .await;
        // This rank's own failure is its own error; another's comes rebuilt.
        let tensors = local?;
        let agreed = agreed?;
        if let Some(wait) = agreed.fence_in {
            // An older writer deletes nothing later than half a lease after it
            // last saw itself current, which was before the claim: after the
            // lease, what is listed stays.
            tokio::time::sleep(wait).await;
        }
        self.chunks()
            .seed_once(
                self.store().as_ref(),
                rank as u32,
                agreed.fence_in.is_some(),
            )
            .await;
        // What this rank writes, and of it the replicas (their records go to the root).
        let mut replicas = std::collections::HashSet::new();
        let mine: Vec<Tensor> = tensors
            .into_iter()
            .filter(|t| {
                let e = index::entry_of(t, rank, world);
                let writes = plan::writes(&agreed.owners, rank as u32, &e);
                if writes && index::in_root(&agreed.owners, &e) {
                    replicas.insert(t.name.clone());
                }
                writes
            })
            .collect();
        let raw_bytes: u64 = mine.iter().map(|t| t.data.len() as u64).sum();

        // 2. Write this rank's share.
        let stats = std::sync::Arc::new(WriteStats::default());
        let written: Result<(WriteOutput, Share)> = async {
            let _gate = self.in_flight().writing().await;
            failpoint::hit("save.before_data").await?;
            let ctx = self.write_context(&id, &job.meta, stats.clone());
            let out = self.format().write(&ctx, &mine).await?;
            let share = if world > 1 {
                let (replicas, tensors) = out
                    .records
                    .iter()
                    .cloned()
                    .partition(|r| replicas.contains(r.name.as_str()));
                let f = Fragment {
                    version: FRAGMENT_VERSION,
                    step: id.step,
                    attempt: id.attempt.clone(),
                    rank: rank as u32,
                    tensors,
                    objects: out.objects.clone(),
                };
                Share::Fragment {
                    fragment: fragment::put(self.store().as_ref(), &f).await?,
                    replicas,
                }
            } else {
                Share::Inline {
                    records: out.records.clone(),
                    objects: out.objects.clone(),
                }
            };
            failpoint::hit("save.after_data").await?;
            Ok((out, share))
        }
        .await;
        drop(mine); // staging buffers go back to the pool
        let share = written
            .as_ref()
            .map(|(_, s)| s.clone())
            .map_err(WireError::from);
        let share = serde_json::to_vec(&share).map_err(|e| Error::Internal(e.to_string()))?;
        let shares = coord
            .gather(share, 0, timeout)
            .await
            .map_err(|e| e.during(format_args!("save of step {}, its commit", id.step)))?
            .iter()
            .map(|b| {
                serde_json::from_slice::<std::result::Result<Share, WireError>>(b)
                    .map_err(|e| Error::Internal(format!("commit: bad message: {e}")))
            })
            .collect::<Result<Vec<_>>>()?;

        // 3. Rank 0 commits; everyone learns the outcome.
        let mut commit = Duration::ZERO;
        let mut deleted = Vec::new();
        let outcome = if rank == 0 {
            let t = Instant::now();
            let ctx = self.write_context(&id, &job.meta, stats.clone());
            let mut o = self
                .commit(&ctx, &id, &shares, job.meta, &agreed.index)
                .await;
            commit = t.elapsed();
            // What GC deleted stays here: it grows with the job (the other
            // ranks forget what their own records of retired ones used).
            deleted = std::mem::take(&mut o.deleted_chunks);
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
        let outcome: CommitOutcome = serde_json::from_slice(
            &coord
                .broadcast(outcome_bytes, 0, timeout)
                .await
                .map_err(|e| e.during(format_args!("save of step {}, its outcome", id.step)))?,
        )
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
        let (written, _) = written?;

        // Every rank now knows the checkpoint is committed, what GC retired,
        // the chunks it wrote, and what GC deleted.
        self.known().insert(id.clone());
        for (step, attempt) in outcome.gc.iter().flat_map(|g| &g.retired) {
            self.known().remove(&CheckpointId {
                step: *step,
                attempt: attempt.clone(),
            });
        }
        let mut mine = Vec::new();
        for r in &written.records {
            if let Layout::Chunks { chunks } = &r.layout {
                for c in chunks {
                    self.chunks().insert(c.hash.clone(), c.stored);
                    mine.push(c.hash.clone());
                }
            }
        }
        self.chunks().note(&id, mine);
        if let Some(g) = &outcome.gc {
            if g.full_sweep {
                self.chunks().forget_all();
            } else {
                let retired: Vec<CheckpointId> = g
                    .retired
                    .iter()
                    .map(|(step, attempt)| CheckpointId {
                        step: *step,
                        attempt: attempt.clone(),
                    })
                    .collect();
                self.chunks().retire(&retired);
            }
        }
        for h in &deleted {
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
            objects: written.objects + u64::from(rank == 0) + u64::from(world > 1),
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
                deleted_chunks: deleted,
                full_sweep: g.full_sweep,
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
        index: &[IndexEntry],
    ) -> CommitOutcome {
        let fail = |r: usize, e: WireError| CommitOutcome {
            result: Err((r, e)),
            deleted_chunks: Vec::new(),
            gc: None,
            committed_by_other: None,
        };
        let mut tensors = Vec::new();
        let mut objects = Vec::new();
        let mut fragments = Vec::new();
        for (r, s) in shares.iter().enumerate() {
            match s {
                Ok(Share::Inline {
                    records,
                    objects: o,
                }) => {
                    tensors.extend(records.iter().cloned());
                    objects.extend(o.iter().cloned());
                }
                Ok(Share::Fragment { fragment, replicas }) => {
                    fragments.push(fragment.clone());
                    tensors.extend(replicas.iter().cloned());
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
        let finished = async {
            if fragments.is_empty() || !self.format().finish_reads_records() {
                return self.format().finish(ctx, &tensors).await;
            }
            // A format whose finish needs every record (an index file) reads
            // the fragments back: O(ranks) reads, for interchange formats only.
            let mut all = tensors.clone();
            for f in &fragments {
                all.extend(fragment::read(self.store().as_ref(), id, f).await?.tensors);
            }
            self.format().finish(ctx, &all).await
        };
        match finished.await {
            Ok(extra) => objects.extend(extra),
            Err(e) => return fail(0, WireError::from(&e)),
        }
        let mut fence = match self.fencing().fence(self.store().as_ref()).await {
            Ok(f) => f,
            Err(e) => return fail(0, WireError::from(&e)),
        };
        let manifest = Manifest {
            version: if fragments.is_empty() {
                MANIFEST_VERSION_INLINE
            } else {
                MANIFEST_VERSION
            },
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
            index: if fragments.is_empty() {
                Vec::new()
            } else {
                index.to_vec()
            },
            fragments,
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
                full_sweep: g.full_sweep,
            }),
        }
    }
}
