//! The storage conformance suite: one set of async checks that every backend
//! (`file://`, `memory://`, S3, the tiered store, any wrapper) must pass.
//!
//! Each check panics (with the property that failed) when the store breaks the
//! contract ckpt relies on, and returns an error when the store could not be used
//! at all. Checks of raw storage (`check_put_get_list_delete`,
//! `check_multipart`) use keys under `conformance/`; the engine-level checks use
//! the checkpoint layout at the root and need a store of their own, empty at the
//! start (a fresh directory, memory name or S3 prefix).
//!
//! ```no_run
//! # async fn demo(format: std::sync::Arc<dyn ckpt_core::Format>) -> ckpt_core::Result<()> {
//! use ckpt_core::{store, testing::conformance};
//! conformance::check_put_get_list_delete(store::memory_store("c1").as_ref()).await?;
//! conformance::check_lists_only_committed(store::memory_store("c2"), format).await?;
//! # Ok(()) }
//! ```

use std::collections::BTreeSet;
use std::sync::Arc;

use bytes::Bytes;
use futures::TryStreamExt;
use object_store::path::Path;
use object_store::{ObjectStore, ObjectStoreExt, PutPayload, WriteMultipart};

use crate::checkpointer::Checkpointer;
use crate::error::{Error, Result};
use crate::format::Format;
use crate::layout::catalog;
use crate::layout::paths;
use crate::load::read::Status;
use crate::model::state::State;
use crate::model::tensor::Tensor;
use crate::model::value::Value;
use crate::model::CheckpointId;

pub use super::seeded::pattern;

async fn keys_under(store: &dyn ObjectStore, prefix: &str) -> Result<BTreeSet<String>> {
    let metas: Vec<_> = store.list(Some(&Path::from(prefix))).try_collect().await?;
    Ok(metas.into_iter().map(|m| m.location.to_string()).collect())
}

fn is_not_found(r: &object_store::Result<impl Sized>) -> bool {
    matches!(r, Err(object_store::Error::NotFound { .. }))
}

/// Put, get (whole, ranges, head), list (recursive and by folder) and delete.
pub async fn check_put_get_list_delete(store: &dyn ObjectStore) -> Result<()> {
    let root = "conformance/basic";
    let objects = [
        ("a", 0usize),
        ("b/one", 1000),
        ("b/two", 70_000),
        ("c/d/e", 3),
    ];
    for (i, (k, len)) in objects.iter().enumerate() {
        store
            .put(
                &Path::from(format!("{root}/{k}")),
                pattern(i as u64, *len).into(),
            )
            .await?;
    }
    for (i, (k, len)) in objects.iter().enumerate() {
        let key = Path::from(format!("{root}/{k}"));
        let got = store.get(&key).await?.bytes().await?;
        assert_eq!(
            got,
            pattern(i as u64, *len),
            "get `{key}` returned other bytes than were put"
        );
        assert_eq!(
            store.head(&key).await?.size,
            *len as u64,
            "head `{key}`: wrong size"
        );
        if *len > 10 {
            let r = store.get_range(&key, 5..10).await?;
            assert_eq!(
                r,
                pattern(i as u64, *len).slice(5..10),
                "range read of `{key}`"
            );
        }
    }
    let want: BTreeSet<String> = objects.iter().map(|(k, _)| format!("{root}/{k}")).collect();
    assert_eq!(keys_under(store, root).await?, want, "recursive listing");
    let b = keys_under(store, &format!("{root}/b")).await?;
    assert_eq!(b.len(), 2, "listing of a sub-prefix: {b:?}");
    let top = store.list_with_delimiter(Some(&Path::from(root))).await?;
    let files: Vec<String> = top.objects.iter().map(|m| m.location.to_string()).collect();
    let dirs: BTreeSet<String> = top.common_prefixes.iter().map(|p| p.to_string()).collect();
    assert_eq!(
        files,
        vec![format!("{root}/a")],
        "objects of a delimited listing"
    );
    assert_eq!(
        dirs,
        [format!("{root}/b"), format!("{root}/c")]
            .into_iter()
            .collect(),
        "folders of a delimited listing"
    );

    // Overwrite replaces the whole object.
    let key = Path::from(format!("{root}/b/one"));
    store.put(&key, pattern(99, 10).into()).await?;
    assert_eq!(
        store.get(&key).await?.bytes().await?,
        pattern(99, 10),
        "overwrite"
    );

    assert!(
        is_not_found(&store.get(&Path::from(format!("{root}/missing"))).await),
        "get of a missing key"
    );
    for k in &want {
        store.delete(&Path::from(k.as_str())).await?;
    }
    assert!(is_not_found(&store.get(&key).await), "get after delete");
    assert!(
        keys_under(store, root).await?.is_empty(),
        "listing after deleting everything"
    );
    // Deleting a missing key is not a failure of the store (it may say NotFound).
    let again = store.delete(&key).await;
    assert!(
        again.is_ok() || is_not_found(&again),
        "delete of a missing key: {again:?}"
    );
    Ok(())
}

/// A large object in parts (several parts of at least 5 MiB, as S3 requires),
/// read back whole and by range; an aborted upload leaves nothing visible.
pub async fn check_multipart(store: &dyn ObjectStore) -> Result<()> {
    let key = Path::from("conformance/multipart/big");
    let len = 12 * (1 << 20) + 12_345;
    let data = pattern(7, len);
    let upload = store.put_multipart(&key).await?;
    let mut w = WriteMultipart::new_with_chunk_size(upload, 5 << 20);
    for piece in data.chunks(1 << 20) {
        w.wait_for_capacity(4).await?;
        w.write(piece);
    }
    w.finish().await?;
    assert_eq!(
        store.head(&key).await?.size,
        len as u64,
        "size of a multipart object"
    );
    assert_eq!(
        store.get(&key).await?.bytes().await?,
        data,
        "bytes of a multipart object"
    );
    let mid = (5 << 20) - 100..(5 << 20) + 100; // across a part boundary
    assert_eq!(
        store
            .get_range(&key, mid.start as u64..mid.end as u64)
            .await?,
        data.slice(mid),
        "range across parts"
    );

    let aborted = Path::from("conformance/multipart/aborted");
    let mut up = store.put_multipart(&aborted).await?;
    up.put_part(PutPayload::from(pattern(8, 5 << 20))).await?;
    up.abort().await?;
    let dropped = Path::from("conformance/multipart/dropped");
    let mut up = store.put_multipart(&dropped).await?;
    up.put_part(PutPayload::from(pattern(9, 5 << 20))).await?;
    drop(up);
    assert!(
        is_not_found(&store.head(&aborted).await),
        "an aborted upload is visible"
    );
    assert!(
        is_not_found(&store.head(&dropped).await),
        "an unfinished upload is visible"
    );
    let listed = keys_under(store, "conformance/multipart").await?;
    assert_eq!(
        listed,
        [key.to_string()].into_iter().collect(),
        "listing after aborted uploads"
    );
    store.delete(&key).await?;
    Ok(())
}

fn state_of(seed: u64, shared: &[f32]) -> Result<State> {
    let own: Vec<f32> = (0..3000).map(|i| (seed * 10_000 + i) as f32).collect();
    Ok(State::new()
        .with_tensor(Tensor::from_f32(
            "shared",
            vec![shared.len() as u64],
            shared,
        )?)
        .with_tensor(Tensor::from_f32("own", vec![own.len() as u64], &own)?)
        .with_meta(Value::map([("writer", Value::Int(seed as i64))])))
}

async fn checkpointer(
    store: &Arc<dyn ObjectStore>,
    format: &Arc<dyn Format>,
) -> Result<Checkpointer> {
    // Separate checkpointers here stand for separate processes writing at
    // once, and what is checked is the store's commit protocol: unfenced
    // writers, so that no claim settles who may commit before the store does.
    let opts = crate::CheckpointerOptions {
        fencing: false,
        ..Default::default()
    };
    Checkpointer::builder("conformance")
        .store(store.clone())
        .format(format.clone())
        .options(opts)
        .build()
        .await
}

/// Several writers (separate checkpointers, as separate processes would be) save
/// the same step at once: each commit either succeeds or is refused as a conflict,
/// nothing is torn or mixed, every committed checkpoint loads as exactly one
/// writer's state, and publishing a second manifest under a committed key never
/// leaves a damaged one (whether or not the store honours create-only puts).
pub async fn check_concurrent_commit(
    store: Arc<dyn ObjectStore>,
    format: Arc<dyn Format>,
) -> Result<()> {
    let shared: Vec<f32> = (0..5000).map(|i| i as f32 * 0.5).collect();
    let writers = 4u64;
    let mut tasks = Vec::new();
    for w in 0..writers {
        let (store, format, shared) = (store.clone(), format.clone(), shared.clone());
        tasks.push(tokio::spawn(async move {
            let cp = checkpointer(&store, &format).await?;
            let state = state_of(w, &shared)?;
            cp.save(10, &state)
                .await?
                .wait()
                .await
                .map(|r| (r.id, state))
        }));
    }
    let mut committed = Vec::new();
    for t in tasks {
        match t.await.map_err(|e| Error::Internal(e.to_string()))? {
            Ok(c) => committed.push(c),
            Err(Error::Conflict(_)) => {}
            Err(e) => return Err(e),
        }
    }
    assert!(!committed.is_empty(), "no concurrent writer committed");
    let listed = catalog::committed(store.as_ref()).await?;
    let cp = checkpointer(&store, &format).await?;
    for (id, state) in &committed {
        assert!(
            listed.contains(id),
            "{id} reported committed but not listed"
        );
        let loaded = cp.load(id).await?;
        assert_eq!(
            &loaded.state, state,
            "{id} does not hold exactly its writer's state"
        );
    }
    assert_eq!(
        listed.len(),
        committed.len(),
        "a checkpoint is listed that no writer committed"
    );

    // A second publish of a committed manifest key, with other contents.
    let (id, _) = &committed[0];
    let original = catalog::read_manifest(store.as_ref(), id).await?;
    let mut other = original.clone();
    other.meta = Value::map([("impostor", Value::Bool(true))]);
    let honoured = match catalog::publish_manifest(store.as_ref(), &other).await {
        Err(Error::Conflict(_)) => true,
        Ok(()) => false,
        Err(e) => return Err(e),
    };
    let now = catalog::read_manifest(store.as_ref(), id).await?;
    if honoured {
        assert_eq!(
            now, original,
            "a refused create-only put changed the manifest"
        );
    } else {
        assert!(
            now == original || now == other,
            "the manifest is neither version after a second put"
        );
    }
    Ok(())
}

/// Only checkpoints with a manifest are listed as committed: the objects of a
/// crashed save are reported as incomplete, never loaded; a torn manifest is
/// skipped by `load_latest`, which returns the newest intact checkpoint.
pub async fn check_lists_only_committed(
    store: Arc<dyn ObjectStore>,
    format: Arc<dyn Format>,
) -> Result<()> {
    let cp = checkpointer(&store, &format).await?;
    let good = state_of(1, &[1.0, 2.0, 3.0])?;
    let id = cp.save(10, &good).await?.wait().await?.id;

    // A crashed save of step 20: a chunk and a data object, no manifest.
    let crashed = CheckpointId {
        step: 20,
        attempt: paths::new_attempt_id(),
    };
    let chunk = pattern(20, 4096);
    store
        .put(
            &paths::chunk_key(blake3::hash(&chunk).to_hex().as_str()),
            chunk.into(),
        )
        .await?;
    store
        .put(
            &paths::data_prefix(&crashed).join("rank0.bin"),
            pattern(21, 1000).into(),
        )
        .await?;
    // A save of step 30 whose manifest is torn (the first half of a real one).
    let torn_id = CheckpointId {
        step: 30,
        attempt: paths::new_attempt_id(),
    };
    let mut manifest = cp.manifest(&id).await?;
    manifest.step = torn_id.step;
    manifest.attempt = torn_id.attempt.clone();
    let bytes = manifest.encode()?;
    store
        .put(
            &paths::manifest_key(&torn_id),
            Bytes::from(bytes[..bytes.len() / 2].to_vec()).into(),
        )
        .await?;

    let committed = cp.committed().await?;
    assert!(
        !committed.contains(&crashed),
        "a save without manifest is listed as committed"
    );
    assert_eq!(
        committed.first(),
        Some(&id),
        "the committed checkpoint is not listed"
    );
    let incomplete = catalog::incomplete(store.as_ref()).await?;
    assert!(
        incomplete.contains_key(&crashed),
        "the crashed save is not reported as incomplete"
    );
    let list = cp.list(false).await?;
    let status = |want: &CheckpointId| {
        list.iter()
            .find(|i| &i.id == want)
            .map(|i| i.status.clone())
    };
    assert_eq!(
        status(&crashed),
        Some(Status::Incomplete),
        "status of the crashed save"
    );
    assert!(
        matches!(status(&torn_id), Some(Status::Corrupt(_))),
        "status of the torn manifest"
    );

    let loaded = cp
        .load_latest()
        .await?
        .expect("an intact checkpoint exists");
    assert_eq!(
        loaded.id, id,
        "load_latest returned something other than the newest intact checkpoint"
    );
    assert_eq!(
        loaded.state, good,
        "load_latest returned other data than was saved"
    );
    assert!(
        loaded.skipped.iter().any(|(s, _)| s == &torn_id),
        "the torn manifest was not reported as skipped"
    );
    Ok(())
}

/// Partial uploads (an aborted multipart upload, one never finished, a crashed
/// save's objects) leave no committed checkpoint, and the next save of that step
/// succeeds and loads back exactly.
pub async fn check_resume_after_partial(
    store: Arc<dyn ObjectStore>,
    format: Arc<dyn Format>,
) -> Result<()> {
    let leftover = CheckpointId {
        step: 5,
        attempt: paths::new_attempt_id(),
    };
    let prefix = paths::data_prefix(&leftover);
    let mut up = store.put_multipart(&prefix.clone().join("big.bin")).await?;
    up.put_part(PutPayload::from(pattern(5, 5 << 20))).await?;
    up.abort().await?;
    let mut up = store
        .put_multipart(&prefix.clone().join("other.bin"))
        .await?;
    up.put_part(PutPayload::from(pattern(6, 5 << 20))).await?;
    drop(up);
    store
        .put(&prefix.clone().join("small.bin"), pattern(7, 100).into())
        .await?;

    let cp = checkpointer(&store, &format).await?;
    assert!(
        cp.committed().await?.is_empty(),
        "partial uploads produced a committed checkpoint"
    );
    assert!(
        cp.load_latest().await?.is_none(),
        "load_latest found a checkpoint among partial uploads"
    );

    let state = state_of(5, &(0..20_000).map(|i| i as f32).collect::<Vec<_>>())?;
    let report = cp.save(5, &state).await?.wait().await?;
    assert_ne!(report.id, leftover);
    let loaded = cp
        .load_latest()
        .await?
        .expect("the resumed save is committed");
    assert_eq!(
        (loaded.id, loaded.state),
        (report.id, state),
        "the resumed save does not load back exactly"
    );
    Ok(())
}

/// Every check, each on a store of its own from `fresh` (called once per check).
pub async fn check_all<F>(mut fresh: F, format: Arc<dyn Format>) -> Result<()>
where
    F: FnMut() -> Result<Arc<dyn ObjectStore>>,
{
    check_put_get_list_delete(fresh()?.as_ref()).await?;
    check_multipart(fresh()?.as_ref()).await?;
    check_concurrent_commit(fresh()?, format.clone()).await?;
    check_lists_only_committed(fresh()?, format.clone()).await?;
    check_resume_after_partial(fresh()?, format).await?;
    Ok(())
}
