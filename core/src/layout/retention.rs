//! Retention (which checkpoints to keep) and garbage collection.
//!
//! GC deletes in the reverse order of a commit: a retired checkpoint's manifest
//! goes first (so it stops existing at once), then its data, then chunks that no
//! kept manifest references. If any kept manifest cannot be read, no chunk is
//! deleted in that round: GC never guesses. Objects younger than a grace
//! period are kept (a save in another process may be writing them), and a
//! writer whose epoch is over deletes nothing ([`Sweep::fence`]).
//!
//! A round is *incremental* ([`Sweep::incremental`], the engine's after most
//! commits) or a *full sweep*. Incremental, it lists only `manifests/` and the
//! retired checkpoints' own `data/` prefixes, and deletes the chunks the
//! retired checkpoints referenced that no kept one does: its cost follows what
//! is retired, not what is stored. What each checkpoint references is read
//! once and remembered ([`Sweep::refs`]). A full sweep also lists all of
//! `data/` (incomplete saves) and `chunks/` (chunks nothing references: a
//! failed save's, or one retired while its manifest was unreadable).
//! Deletes go out as one stream (`delete_stream`: batched requests where the
//! store has them, S3's DeleteObjects).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use futures::{StreamExt, TryStreamExt};
use object_store::path::Path;
use object_store::{ObjectMeta, ObjectStore, ObjectStoreExt};

use crate::error::Result;
use crate::failpoint;
use crate::layout::catalog;
use crate::layout::chunks::ChunkIndex;
use crate::layout::epoch::{self, EpochView, Fence, ManifestEpochs};
use crate::layout::paths::{self, CHUNKS, DATA};
use crate::model::CheckpointId;
use crate::sync::MutexExt;

/// Which committed checkpoints to keep.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Retention {
    /// Keep the newest N committed checkpoints (`None`: keep all).
    pub keep_last: Option<usize>,
    /// Also keep every checkpoint whose step is a multiple of K.
    pub keep_every: Option<u64>,
}

impl Retention {
    /// Keep everything.
    pub fn keep_all() -> Self {
        Self::default()
    }

    /// Keep the newest `n`.
    pub fn keep_last(n: usize) -> Self {
        Retention {
            keep_last: Some(n),
            keep_every: None,
        }
    }

    /// Whether `keep_every` keeps `step` whatever its age.
    pub fn archives(&self, step: u64) -> bool {
        self.keep_every.is_some_and(|k| k > 0 && step % k == 0)
    }

    /// Split ids (oldest first) into kept and retired.
    pub fn partition(&self, ids: &[CheckpointId]) -> (Vec<CheckpointId>, Vec<CheckpointId>) {
        let Some(n) = self.keep_last else {
            return (ids.to_vec(), Vec::new());
        };
        let cut = ids.len().saturating_sub(n.max(1));
        ids.iter()
            .enumerate()
            .fold((Vec::new(), Vec::new()), |(mut keep, mut drop), (i, id)| {
                if i >= cut || self.archives(id.step) {
                    keep.push(id.clone());
                } else {
                    drop.push(id.clone());
                }
                (keep, drop)
            })
    }
}

/// What a GC round did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct GcReport {
    /// Checkpoints retired (manifest and data deleted).
    pub retired: Vec<CheckpointId>,
    /// Incomplete saves whose data was deleted.
    pub incomplete_removed: Vec<CheckpointId>,
    /// Chunks deleted.
    pub chunks_deleted: u64,
    /// True when chunk sweeping was skipped because a kept manifest was unreadable.
    pub chunk_sweep_skipped: bool,
    /// Hashes of the chunks deleted.
    pub deleted_chunks: Vec<String>,
    /// True for a full sweep (listing `data/` and `chunks/`).
    pub full_sweep: bool,
}

/// How a GC round treats what may still be in use.
#[derive(Debug, Clone, Default)]
pub struct Sweep {
    /// Objects (chunks, data of incomplete saves) younger than this are kept:
    /// they may belong to a save in flight in another process.
    pub grace: Duration,
    /// The writer's fence: the round fails with [`crate::Error::Fenced`], having
    /// deleted nothing after the fence closed, once a newer epoch claims the root.
    /// `None`: an unfenced collector (a root no writer claimed).
    pub fence: Option<Fence>,
    /// The epochs of manifests already read (kept between rounds by whoever
    /// collects again).
    pub epochs: Arc<ManifestEpochs>,
    /// List only what is retired (see the module docs); `false`: a full sweep.
    pub incremental: bool,
    /// The chunks each checkpoint references, once read (kept between rounds).
    pub refs: Arc<Refs>,
}

/// The chunks each checkpoint references, as read from its manifest (and
/// fragments): a checkpoint never changes, so each is read once.
#[derive(Debug, Default)]
pub struct Refs(Mutex<HashMap<CheckpointId, Arc<HashSet<String>>>>);

impl Refs {
    /// The chunks `id` references.
    pub async fn of(
        &self,
        store: &dyn ObjectStore,
        id: &CheckpointId,
    ) -> Result<Arc<HashSet<String>>> {
        if let Some(r) = self.0.lock_unpoisoned().get(id) {
            return Ok(r.clone());
        }
        let m = catalog::read_full(store, id).await?;
        let set: Arc<HashSet<String>> = Arc::new(m.chunk_hashes().map(str::to_owned).collect());
        self.0.lock_unpoisoned().insert(id.clone(), set.clone());
        Ok(set)
    }

    /// Forget checkpoints other than `live`.
    fn keep_only(&self, live: &[CheckpointId]) {
        let live: HashSet<&CheckpointId> = live.iter().collect();
        self.0.lock_unpoisoned().retain(|id, _| live.contains(id));
    }
}

/// Apply a retention policy and sweep garbage.
///
/// `protected` names checkpoints that must not be touched (saves in flight in this
/// process). The caller must make sure no save in flight relies on chunks that are
/// only referenced by retired checkpoints (the engine runs GC only while no save is
/// writing).
///
/// Retention counts the checkpoints that are valid under the root's newest
/// epoch claim; checkpoints a fenced writer committed after it was fenced
/// ([zombies](crate::layout::epoch::Verdict::Zombie)) are retired whatever
/// the policy, and never count as referencing a chunk.
pub async fn collect(
    store: &dyn ObjectStore,
    retention: &Retention,
    chunks: &ChunkIndex,
    protected: &HashSet<CheckpointId>,
    sweep: &mut Sweep,
) -> Result<GcReport> {
    let mut report = GcReport {
        full_sweep: !sweep.incremental,
        ..GcReport::default()
    };
    let view = EpochView::read(store).await?;
    let (valid, zombies) = epoch::partition_committed(store, &view, &sweep.epochs).await?;
    let (kept, mut retired) = retention.partition(&valid);
    retired.extend(zombies.into_iter().filter(|id| !protected.contains(id)));
    let now_ms = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default()
        .as_millis() as i64;
    let grace_ms = sweep.grace.as_millis() as i64;
    let young = |m: &ObjectMeta| now_ms - m.last_modified.timestamp_millis() < grace_ms;
    failpoint::hit("gc.before_delete").await?;
    if let Some(f) = sweep.fence.as_mut() {
        f.check(store).await?;
    }
    // What the retired checkpoints referenced, read before they go (an
    // unreadable one leaves its chunks to a full sweep).
    let mut gone: HashSet<String> = HashSet::new();
    if sweep.incremental {
        for id in &retired {
            if let Ok(r) = sweep.refs.of(store, id).await {
                gone.extend(r.iter().cloned());
            }
        }
    }
    for id in retired {
        if let Some(f) = sweep.fence.as_mut() {
            f.recheck(store).await?;
        }
        match store.delete(&paths::manifest_key(&id)).await {
            Ok(()) | Err(object_store::Error::NotFound { .. }) => {}
            Err(e) => return Err(e.into()),
        }
        catalog::delete_data(store, &id).await?;
        report.retired.push(id);
    }

    if !sweep.incremental {
        remove_incomplete(store, &kept, protected, sweep, &young, &mut report).await?;
        remove_attendance(store, &young).await?;
    }

    let mut live = HashSet::new();
    for id in &kept {
        match sweep.refs.of(store, id).await {
            Ok(r) => live.extend(r.iter().cloned()),
            Err(_) => {
                report.chunk_sweep_skipped = true;
                return Ok(report);
            }
        }
    }
    sweep.refs.keep_only(&kept);
    let doomed: Vec<String> = if sweep.incremental {
        gone.into_iter().filter(|h| !live.contains(h)).collect()
    } else {
        let prefix = Path::from(CHUNKS);
        let metas: Vec<_> = store.list(Some(&prefix)).try_collect().await?;
        metas
            .iter()
            .filter(|m| !young(m))
            .filter_map(|m| m.location.filename())
            .filter(|h| !live.contains(*h))
            .map(str::to_owned)
            .collect()
    };
    if doomed.is_empty() {
        return Ok(report);
    }
    if let Some(f) = sweep.fence.as_mut() {
        f.recheck(store).await?;
    }
    for h in &doomed {
        chunks.remove(h);
    }
    // One stream of deletes, checked against the fence every 1,000.
    for batch in doomed.chunks(1000) {
        if let Some(f) = sweep.fence.as_mut() {
            f.recheck(store).await?;
        }
        let keys = batch
            .iter()
            .map(|h| Ok(paths::chunk_key(h)))
            .collect::<Vec<_>>();
        let mut results = store.delete_stream(futures::stream::iter(keys).boxed());
        while let Some(r) = results.next().await {
            match r {
                Ok(_) | Err(object_store::Error::NotFound { .. }) => report.chunks_deleted += 1,
                Err(e) => return Err(e.into()),
            }
        }
        report.deleted_chunks.extend(batch.iter().cloned());
    }
    Ok(report)
}

/// A full sweep's part: attendance marks ([`crate::coord::RollCall`]) older
/// than the grace period; a failed collective leaves one per rank that waited.
async fn remove_attendance(
    store: &dyn ObjectStore,
    young: &(dyn Fn(&ObjectMeta) -> bool + Sync),
) -> Result<()> {
    let marks: Vec<ObjectMeta> = store
        .list(Some(&Path::from(paths::ATTENDANCE)))
        .try_collect()
        .await?;
    let old: Vec<_> = marks
        .into_iter()
        .filter(|m| !young(m))
        .map(|m| Ok(m.location))
        .collect();
    let mut results = store.delete_stream(futures::stream::iter(old).boxed());
    while let Some(r) = results.next().await {
        match r {
            Ok(_) | Err(object_store::Error::NotFound { .. }) => {}
            Err(e) => return Err(e.into()),
        }
    }
    Ok(())
}

/// A full sweep's part: incomplete saves older than the newest commit can
/// never be committed by this job any more (a save of a step at or below the
/// latest is refused); their data goes.
async fn remove_incomplete(
    store: &dyn ObjectStore,
    kept: &[CheckpointId],
    protected: &HashSet<CheckpointId>,
    sweep: &mut Sweep,
    young: &(dyn Fn(&ObjectMeta) -> bool + Sync),
    report: &mut GcReport,
) -> Result<()> {
    let newest = kept.last().map(|id| id.step);
    let done: HashSet<CheckpointId> = catalog::committed(store).await?.into_iter().collect();
    let data: Vec<ObjectMeta> = store.list(Some(&Path::from(DATA))).try_collect().await?;
    let mut incomplete: BTreeMap<CheckpointId, bool> = BTreeMap::new();
    for m in &data {
        if let Some(id) = paths::parse_data_key(&m.location) {
            if !done.contains(&id) {
                *incomplete.entry(id).or_insert(false) |= young(m);
            }
        }
    }
    for (id, has_young) in incomplete {
        if newest.is_some_and(|n| id.step <= n) && !protected.contains(&id) && !has_young {
            if let Some(f) = sweep.fence.as_mut() {
                f.recheck(store).await?;
            }
            catalog::delete_data(store, &id).await?;
            report.incomplete_removed.push(id);
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ids(steps: &[u64]) -> Vec<CheckpointId> {
        steps
            .iter()
            .map(|&s| CheckpointId {
                step: s,
                attempt: "a".into(),
            })
            .collect()
    }

    #[test]
    fn keep_last_and_every() {
        let all = ids(&[10, 20, 30, 40, 50, 60]);
        let (keep, drop) = Retention::keep_last(2).partition(&all);
        assert_eq!(keep, ids(&[50, 60]));
        assert_eq!(drop, ids(&[10, 20, 30, 40]));
        let r = Retention {
            keep_last: Some(1),
            keep_every: Some(20),
        };
        let (keep, drop) = r.partition(&all);
        assert_eq!(keep, ids(&[20, 40, 60]));
        assert_eq!(drop, ids(&[10, 30, 50]));
        let (keep, drop) = Retention::keep_all().partition(&all);
        assert_eq!((keep.len(), drop.len()), (6, 0));
        // keep_last(0) would delete the newest checkpoint: it is treated as 1.
        assert_eq!(Retention::keep_last(0).partition(&all).0, ids(&[60]));
    }
}
