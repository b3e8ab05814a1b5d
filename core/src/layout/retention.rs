//! Retention (which checkpoints to keep) and garbage collection.
//!
//! GC deletes in the reverse order of a commit: a retired checkpoint's manifest
//! goes first (so it stops existing at once), then its data, then chunks that no
//! kept manifest references. If any kept manifest cannot be read, no chunk is
//! deleted in that round: GC never guesses.

use std::collections::HashSet;

use futures::TryStreamExt;
use object_store::path::Path;
use object_store::{ObjectStore, ObjectStoreExt};

use crate::error::Result;
use crate::failpoint;
use crate::layout::catalog;
use crate::layout::chunks::ChunkIndex;
use crate::layout::paths::{self, CHUNKS};
use crate::model::CheckpointId;

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

    /// Split ids (oldest first) into kept and retired.
    pub fn partition(&self, ids: &[CheckpointId]) -> (Vec<CheckpointId>, Vec<CheckpointId>) {
        let Some(n) = self.keep_last else {
            return (ids.to_vec(), Vec::new());
        };
        let cut = ids.len().saturating_sub(n.max(1));
        ids.iter()
            .enumerate()
            .fold((Vec::new(), Vec::new()), |(mut keep, mut drop), (i, id)| {
                let every = self.keep_every.is_some_and(|k| k > 0 && id.step % k == 0);
                if i >= cut || every {
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
}

/// Apply a retention policy and sweep garbage.
///
/// `protected` names checkpoints that must not be touched (saves in flight in this
/// process). The caller must make sure no save in flight relies on chunks that are
/// only referenced by retired checkpoints (the engine runs GC only while no save is
/// writing).
pub async fn collect(
    store: &dyn ObjectStore,
    retention: &Retention,
    chunks: &ChunkIndex,
    protected: &HashSet<CheckpointId>,
) -> Result<GcReport> {
    let mut report = GcReport::default();
    let ids = catalog::committed(store).await?;
    let (kept, retired) = retention.partition(&ids);
    failpoint::hit("gc.before_delete").await?;
    for id in retired {
        match store.delete(&paths::manifest_key(&id)).await {
            Ok(()) | Err(object_store::Error::NotFound { .. }) => {}
            Err(e) => return Err(e.into()),
        }
        catalog::delete_data(store, &id).await?;
        report.retired.push(id);
    }

    // Incomplete saves older than the newest commit can never be committed by this
    // job any more (a save of a step at or below the latest is refused).
    let newest = kept.last().map(|id| id.step);
    for (id, _) in catalog::incomplete(store).await? {
        if newest.is_some_and(|n| id.step <= n) && !protected.contains(&id) {
            catalog::delete_data(store, &id).await?;
            report.incomplete_removed.push(id);
        }
    }

    let mut live = HashSet::new();
    for id in &kept {
        match catalog::read_manifest(store, id).await {
            Ok(m) => live.extend(m.chunk_hashes().map(str::to_owned)),
            Err(_) => {
                report.chunk_sweep_skipped = true;
                return Ok(report);
            }
        }
    }
    let prefix = Path::from(CHUNKS);
    let metas: Vec<_> = store.list(Some(&prefix)).try_collect().await?;
    for m in metas {
        let Some(hash) = m.location.filename() else {
            continue;
        };
        if !live.contains(hash) {
            chunks.remove(hash);
            match store.delete(&m.location).await {
                Ok(()) | Err(object_store::Error::NotFound { .. }) => {
                    report.chunks_deleted += 1;
                    report.deleted_chunks.push(hash.to_owned());
                }
                Err(e) => return Err(e.into()),
            }
        }
    }
    Ok(report)
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
