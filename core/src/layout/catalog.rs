//! What is stored under a root: committed checkpoints, incomplete ones, their status.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use futures::{StreamExt, TryStreamExt};
use object_store::path::Path;
use object_store::{ObjectStore, ObjectStoreExt, PutMode, PutOptions, PutPayload};

use crate::error::{Error, Result};
use crate::layout::fragment::{self, Fragment, FragmentRef};
use crate::layout::index::IndexEntry;
use crate::layout::manifest::{validate_records, Manifest};
use crate::layout::paths::{self, DATA, MANIFESTS};
use crate::model::CheckpointId;

/// Ids of every committed checkpoint (a manifest exists), oldest first.
///
/// Ordered by step, then attempt; a listing never shows a checkpoint before its
/// manifest is durable, so nothing here can be torn (it can still be corrupt).
pub async fn committed(store: &dyn ObjectStore) -> Result<Vec<CheckpointId>> {
    let prefix = Path::from(MANIFESTS);
    let metas: Vec<_> = store.list(Some(&prefix)).try_collect().await?;
    let set: BTreeSet<CheckpointId> = metas
        .iter()
        .filter_map(|m| paths::parse_manifest_key(&m.location))
        .collect();
    Ok(set.into_iter().collect())
}

/// Ids that have data objects but no manifest: saves that crashed or are in progress,
/// with the total size of their objects.
pub async fn incomplete(store: &dyn ObjectStore) -> Result<BTreeMap<CheckpointId, u64>> {
    let done: BTreeSet<CheckpointId> = committed(store).await?.into_iter().collect();
    let prefix = Path::from(DATA);
    let metas: Vec<_> = store.list(Some(&prefix)).try_collect().await?;
    let mut out = BTreeMap::new();
    for m in metas {
        if let Some(id) = paths::parse_data_key(&m.location) {
            if !done.contains(&id) {
                *out.entry(id).or_insert(0) += m.size;
            }
        }
    }
    Ok(out)
}

/// Ids that have a folder of their own under `data/` but no manifest: saves
/// that were cut off (or are in progress), from one listing of `data/` by
/// folder, not of its objects, and one of `manifests/`. A native save of
/// one rank keeps nothing under `data/` before its commit (its chunks are
/// named by content), so one cut off there is not among them.
pub async fn uncommitted(store: &dyn ObjectStore) -> Result<Vec<CheckpointId>> {
    let done: BTreeSet<CheckpointId> = committed(store).await?.into_iter().collect();
    let folders = match store.list_with_delimiter(Some(&Path::from(DATA))).await {
        Err(object_store::Error::NotFound { .. }) => return Ok(Vec::new()),
        r => r?.common_prefixes,
    };
    let mut out: Vec<CheckpointId> = folders
        .iter()
        .filter_map(|p| paths::parse_checkpoint_name(p.filename()?))
        .filter(|id| !done.contains(id))
        .collect();
    out.sort();
    Ok(out)
}

/// Read and validate the manifest of a checkpoint.
pub async fn read_manifest(store: &dyn ObjectStore, id: &CheckpointId) -> Result<Manifest> {
    let key = paths::manifest_key(id);
    let bytes = match manifest_bytes(store, &key).await {
        Err(Error::Storage(object_store::Error::NotFound { .. })) => {
            return Err(Error::NotFound {
                what: format!("checkpoint {id}"),
            });
        }
        r => r?,
    };
    let m = Manifest::decode(&bytes, key.as_ref())?;
    if m.id() != *id {
        return Err(Error::corrupt(
            key.as_ref(),
            None,
            format!("manifest is for {}, not {id}", m.id()),
        ));
    }
    Ok(m)
}

/// Read a checkpoint's manifest with every record: a root's fragments are
/// read and their records put in `tensors` (and their keys in `objects`).
pub async fn read_full(store: &dyn ObjectStore, id: &CheckpointId) -> Result<Manifest> {
    let root = read_manifest(store, id).await?;
    expand(store, root, None).await
}

/// A root with the records of its fragments of the ranks in `only` (every
/// rank's if `None`) in `tensors`, their keys in `objects`, read in parallel
/// and each checked against the root's hash of it; every record must be one
/// the root's index lists, of its dtype and shape. A manifest that holds its
/// records is returned as it is.
pub async fn expand(
    store: &dyn ObjectStore,
    mut root: Manifest,
    only: Option<&BTreeSet<u32>>,
) -> Result<Manifest> {
    if !root.has_fragments() {
        return Ok(root);
    }
    let id = root.id();
    let wanted: Vec<FragmentRef> = root
        .fragments
        .iter()
        .filter(|f| only.is_none_or(|o| o.contains(&f.rank)))
        .cloned()
        .collect();
    let frags: Vec<Fragment> = futures::stream::iter(wanted)
        .map(|f| {
            let id = id.clone();
            async move { fragment::read(store, &id, &f).await }
        })
        .buffered(16)
        .try_collect()
        .await?;
    let index: HashMap<&str, &IndexEntry> =
        root.index.iter().map(|e| (e.name.as_str(), e)).collect();
    // The root's own records (replicated tensors), then the fragments'.
    let mut tensors = std::mem::take(&mut root.tensors);
    let mut objects = Vec::new();
    for f in frags {
        let key = fragment::fragment_key(&id, f.rank);
        for t in &f.tensors {
            let global = t.shard.as_ref().map_or(&t.shape, |s| &s.global_shape);
            let listed = IndexEntry::find(&index, &t.name).is_some_and(|(e, own)| {
                !e.in_root()
                    && e.dtype == t.dtype
                    && &e.shape == global
                    && e.sharded == t.shard.is_some()
                    && own.is_none_or(|r| r == f.rank)
            });
            if !listed {
                return Err(Error::corrupt(
                    key.as_ref(),
                    Some(&t.name),
                    "the fragment holds a tensor the root's index does not list so",
                ));
            }
        }
        tensors.extend(f.tensors);
        objects.push(key.to_string());
        objects.extend(f.objects);
    }
    validate_records(&tensors, &objects).map_err(|e| match e {
        Error::InvalidInput(why) => Error::corrupt(paths::manifest_key(&id).as_ref(), None, why),
        other => other,
    })?;
    root.tensors = tensors;
    root.objects.extend(objects);
    Ok(root)
}

/// The stored bytes of the manifest at `key`, refused as corrupt before any of
/// its body is read when the store says it is over
/// [`MAX_MANIFEST_BYTES`](crate::layout::manifest::MAX_MANIFEST_BYTES).
pub async fn manifest_bytes(store: &dyn ObjectStore, key: &Path) -> Result<bytes::Bytes> {
    let r = store.get(key).await?;
    let cap = crate::layout::manifest::MAX_MANIFEST_BYTES as u64;
    if r.meta.size > cap {
        return Err(Error::corrupt(
            key.as_ref(),
            None,
            format!(
                "manifest of {} bytes exceeds the cap of {cap}; not read",
                r.meta.size
            ),
        ));
    }
    Ok(r.bytes().await?)
}

/// Publish a manifest: the commit point of a checkpoint.
///
/// The key is unique to this save attempt, so even a store that ignores
/// create-only puts (Garage did) cannot overwrite another save's manifest; where
/// the store does honour [`PutMode::Create`] it is used as a second guard.
pub async fn publish_manifest(store: &dyn ObjectStore, manifest: &Manifest) -> Result<()> {
    manifest.validate()?;
    let key = paths::manifest_key(&manifest.id());
    let bytes = manifest.encode()?;
    let opts = PutOptions {
        mode: PutMode::Create,
        ..Default::default()
    };
    match store
        .put_opts(&key, PutPayload::from(bytes.clone()), opts)
        .await
    {
        Ok(_) => Ok(()),
        Err(object_store::Error::AlreadyExists { .. }) => Err(Error::Conflict(format!(
            "manifest `{key}` already exists; it is left as it was"
        ))),
        Err(object_store::Error::NotImplemented { .. }) => {
            store.put(&key, PutPayload::from(bytes)).await?;
            Ok(())
        }
        Err(e) => Err(e.into()),
    }
}

/// Committed checkpoints of one step.
pub async fn committed_at(store: &dyn ObjectStore, step: u64) -> Result<Vec<CheckpointId>> {
    Ok(committed(store)
        .await?
        .into_iter()
        .filter(|id| id.step == step)
        .collect())
}

/// Delete every object under a checkpoint's `data/` prefix.
pub async fn delete_data(store: &dyn ObjectStore, id: &CheckpointId) -> Result<u64> {
    let prefix = paths::data_prefix(id);
    let metas: Vec<_> = store.list(Some(&prefix)).try_collect().await?;
    let mut n = 0;
    for m in metas {
        match store.delete(&m.location).await {
            Ok(()) | Err(object_store::Error::NotFound { .. }) => n += 1,
            Err(e) => return Err(e.into()),
        }
    }
    Ok(n)
}
