//! The background flusher of a [`TieredStore`](super::TieredStore): copies each
//! checkpoint committed on the fast tier to the durable tier, manifest last, then
//! runs deferred deletes and the durable tier's retention.

use std::collections::{BTreeSet, HashSet};
use std::sync::Arc;
use std::time::Duration;

use futures::{StreamExt, TryStreamExt};
use object_store::path::Path;
use object_store::{ObjectStore, ObjectStoreExt, PutMode, PutOptions, PutPayload, WriteMultipart};

use super::{Pending, Tiers};
use crate::error::{Error, Result};
use crate::layout::catalog;
use crate::layout::chunks::ChunkIndex;
use crate::layout::epoch::Fence;
use crate::layout::manifest::Manifest;
use crate::layout::paths;
use crate::layout::retention::{self, Sweep};
use crate::model::CheckpointId;
use crate::sync::MutexExt;

/// Queue a checkpoint and make sure the flusher runs.
pub(super) fn enqueue(tiers: &Arc<Tiers>, pending: Pending) {
    let id = pending.manifest.id();
    let mut st = tiers.lock();
    if st.active.as_ref().is_some_and(|p| p.manifest.id() == id) {
        return;
    }
    st.queue.entry(id).or_insert_with(|| Arc::new(pending));
    start(tiers, &mut st);
}

fn start(tiers: &Arc<Tiers>, st: &mut super::FlushState) {
    if st.running || st.queue.is_empty() {
        return;
    }
    // Without a runtime (a put from outside tokio cannot happen) the queue waits for `flush`.
    if let Ok(rt) = tokio::runtime::Handle::try_current() {
        st.running = true;
        rt.spawn(run(tiers.clone()));
    }
}

/// Queue what the fast tier committed and the durable tier lacks.
pub(super) async fn resync(tiers: &Arc<Tiers>) -> Result<()> {
    let fast = match catalog::committed(tiers.fast.as_ref()).await {
        Err(Error::Storage(object_store::Error::NotFound { .. })) => Vec::new(),
        r => r?,
    };
    let durable: BTreeSet<CheckpointId> = catalog::committed(tiers.durable.as_ref())
        .await?
        .into_iter()
        .collect();
    for id in fast.into_iter().filter(|id| !durable.contains(id)) {
        {
            let st = tiers.lock();
            if st.queue.contains_key(&id)
                || st.active.as_ref().is_some_and(|p| p.manifest.id() == id)
            {
                continue;
            }
        }
        let key = paths::manifest_key(&id);
        let bytes = match catalog::manifest_bytes(tiers.fast.as_ref(), &key).await {
            Ok(b) => b,
            Err(Error::Storage(object_store::Error::NotFound { .. })) => continue, // retired meanwhile
            Err(e) if e.is_unusable() => {
                tracing::warn!("fast tier manifest `{key}` is damaged ({e}); it is not flushed");
                continue;
            }
            Err(e) => return Err(e),
        };
        match Manifest::decode(&bytes, key.as_ref()) {
            Ok(m) if m.id() == id => match catalog::expand(tiers.fast.as_ref(), m, None).await {
                Ok(m) => enqueue(tiers, Pending::new(m, bytes)),
                Err(e) => {
                    tracing::warn!("`{key}`'s fragments could not be read ({e}); not flushed")
                }
            },
            Ok(_) | Err(_) => {
                tracing::warn!("fast tier manifest `{key}` is damaged; it is not flushed")
            }
        }
    }
    // Wake the flusher even if nothing new was queued (an earlier put outside a runtime).
    let mut st = tiers.lock();
    start(tiers, &mut st);
    Ok(())
}

async fn run(tiers: Arc<Tiers>) {
    loop {
        let pending = {
            let mut st = tiers.lock();
            match st.queue.pop_first() {
                Some((_, p)) => {
                    st.active = Some(p.clone());
                    p
                }
                None => {
                    st.running = false;
                    drop(st);
                    tiers.idle.notify_waiters();
                    return;
                }
            }
        };
        let id = pending.manifest.id();
        let r = flush_with_retries(&tiers, &pending).await;
        {
            let mut st = tiers.lock();
            st.active = None;
            // One entry per checkpoint: its latest failure, none once it is flushed.
            st.failed.retain(|(f, _)| *f != id);
            match r {
                Ok(()) => {
                    st.flushed.push(id.clone());
                    tiers
                        .writer_epoch
                        .fetch_max(pending.manifest.epoch, std::sync::atomic::Ordering::AcqRel);
                }
                Err(e) => {
                    tracing::warn!("flush of {id} to the durable tier failed: {e}");
                    st.failed.push((id.clone(), e));
                }
            }
        }
        run_deferred(&tiers).await;
        if tiers.lock().queue.is_empty() {
            durable_retention(&tiers).await;
        }
    }
}

/// The fencing lease of durable retention (as the engine's default).
const DURABLE_LEASE: Duration = Duration::from_secs(2);

async fn flush_with_retries(tiers: &Tiers, pending: &Pending) -> Result<()> {
    let mut attempt = 0;
    loop {
        match flush_one(tiers, pending).await {
            Err(e) if !e.is_unusable() && attempt + 1 < tiers.opts.attempts.max(1) => {
                tokio::time::sleep(tiers.opts.backoff.saturating_mul(1 << attempt.min(16))).await;
                attempt += 1;
            }
            r => return r,
        }
    }
}

async fn durable_chunks(tiers: &Tiers) -> Result<&ChunkIndex> {
    tiers
        .durable_chunks
        .get_or_try_init(|| ChunkIndex::scan(tiers.durable.as_ref()))
        .await
}

/// Copy one checkpoint to the durable tier: chunks and data first, manifest last.
async fn flush_one(tiers: &Tiers, pending: &Pending) -> Result<()> {
    let id = pending.manifest.id();
    let index = durable_chunks(tiers).await?;
    let mut keys: Vec<Path> = pending
        .chunks
        .iter()
        .filter(|h| index.get(h).is_none())
        .map(|h| paths::chunk_key(h))
        .collect();
    let mut data: HashSet<Path> = pending
        .manifest
        .objects
        .iter()
        .map(|o| Path::from(o.as_str()))
        .collect();
    let listed: Vec<_> = match tiers
        .fast
        .list(Some(&paths::data_prefix(&id)))
        .try_collect()
        .await
    {
        Err(object_store::Error::NotFound { .. }) => Vec::new(),
        r => r?,
    };
    data.extend(listed.into_iter().map(|m| m.location));
    keys.extend(data);

    futures::stream::iter(keys)
        .map(|key| async move {
            let size = copy_object(tiers, &key).await?;
            if let Some(hash) = key.filename().filter(|_| super::under_chunks(&key)) {
                index.insert(hash.to_owned(), size);
            }
            Ok::<_, Error>(())
        })
        .buffer_unordered(tiers.opts.concurrency.max(1))
        .try_collect::<Vec<()>>()
        .await?;

    // The commit on the durable tier.
    let key = paths::manifest_key(&id);
    let opts = PutOptions {
        mode: PutMode::Create,
        ..Default::default()
    };
    match tiers
        .durable
        .put_opts(&key, PutPayload::from(pending.bytes.clone()), opts)
        .await
    {
        Ok(_) => Ok(()),
        Err(object_store::Error::NotImplemented { .. }) => {
            tiers
                .durable
                .put(&key, PutPayload::from(pending.bytes.clone()))
                .await?;
            Ok(())
        }
        // Already there (an earlier flush whose reply was lost): fine if it is the same manifest.
        Err(object_store::Error::AlreadyExists { .. }) => {
            let stored = catalog::manifest_bytes(tiers.durable.as_ref(), &key).await?;
            if stored == pending.bytes {
                Ok(())
            } else {
                Err(Error::Conflict(format!(
                    "durable tier holds a different `{key}`; it is left as it was"
                )))
            }
        }
        Err(e) => Err(e.into()),
    }
}

/// Copy one object from the fast tier to the durable tier; returns its size.
async fn copy_object(tiers: &Tiers, key: &Path) -> Result<u64> {
    let got = match tiers.fast.get(key).await {
        Ok(g) => g,
        Err(object_store::Error::NotFound { .. }) => {
            // Not on the fast tier: acceptable only if the durable tier has it already.
            return match tiers.durable.head(key).await {
                Ok(meta) => Ok(meta.size),
                Err(object_store::Error::NotFound { .. }) => Err(Error::corrupt(
                    key.as_ref(),
                    None,
                    "missing on both tiers; the checkpoint cannot be flushed",
                )),
                Err(e) => Err(e.into()),
            };
        }
        Err(e) => return Err(e.into()),
    };
    let size = got.meta.size;
    if size <= tiers.opts.multipart_threshold {
        let bytes = got.bytes().await?;
        if bytes.len() as u64 != size {
            return Err(Error::corrupt(
                key.as_ref(),
                None,
                "fast tier returned a short object",
            ));
        }
        tiers.durable.put(key, PutPayload::from(bytes)).await?;
        return Ok(size);
    }
    let upload = tiers.durable.put_multipart(key).await?;
    let mut w = WriteMultipart::new_with_chunk_size(upload, 16 << 20);
    let mut stream = got.into_stream();
    let mut copied = 0u64;
    let r: Result<()> = async {
        while let Some(b) = stream.try_next().await? {
            w.wait_for_capacity(4).await?;
            copied += b.len() as u64;
            w.write(&b);
        }
        Ok(())
    }
    .await;
    if let Err(e) = r {
        let _ = w.abort().await;
        return Err(e);
    }
    if copied != size {
        let _ = w.abort().await;
        return Err(Error::corrupt(
            key.as_ref(),
            None,
            "fast tier returned a short object",
        ));
    }
    w.finish().await?;
    Ok(size)
}

/// Run the deletes that waited for flushes, unless a queued flush still needs them.
async fn run_deferred(tiers: &Tiers) {
    let _gate = tiers.gate.write().await;
    let ready: Vec<Path> = {
        let mut st = tiers.lock();
        let ready: Vec<Path> = st
            .deferred
            .iter()
            .filter(|k| !st.needed(k))
            .cloned()
            .collect();
        for k in &ready {
            st.deferred.remove(k);
        }
        ready
    };
    for key in ready {
        match tiers.fast.delete(&key).await {
            Ok(()) | Err(object_store::Error::NotFound { .. }) => {}
            Err(e) => tracing::warn!("deferred delete of `{key}` on the fast tier failed: {e}"),
        }
    }
}

async fn durable_retention(tiers: &Tiers) {
    if tiers.opts.durable_retention.keep_last.is_none() {
        return;
    }
    let index = match durable_chunks(tiers).await {
        Ok(i) => i,
        Err(e) => {
            tracing::warn!("durable tier retention skipped: {e}");
            return;
        }
    };
    let epoch = writer_epoch(tiers).await;
    let mut sweep = Sweep {
        grace: tiers.opts.durable_grace,
        fence: (epoch > 0).then(|| Fence::new(epoch, DURABLE_LEASE)),
        epochs: tiers.durable_epochs.clone(),
        ..Sweep::default()
    };
    if let Err(e) = retention::collect(
        tiers.durable.as_ref(),
        &tiers.opts.durable_retention,
        index,
        &HashSet::new(),
        &mut sweep,
    )
    .await
    {
        tracing::warn!("durable tier retention failed (retried after the next flush): {e}");
    }
}

/// The epoch durable retention runs fenced by: the newest among the
/// manifests flushed, or the newest claim this store's writer put on the
/// durable tier where that tier still holds it as put (then it is this
/// writer's own, which a best-effort claim lost to a rival's put would not
/// be). A restarted writer claims before anything it flushes carries its
/// epoch, and fenced by an older one its retention would fail, fenced by its
/// own claim, until its first save is flushed.
async fn writer_epoch(tiers: &Tiers) -> u64 {
    use std::sync::atomic::Ordering;
    let flushed = tiers.writer_epoch.load(Ordering::Acquire);
    let claimed = tiers.claimed.lock_unpoisoned().clone();
    let Some((epoch, bytes)) = claimed.filter(|(e, _)| *e > flushed) else {
        return flushed;
    };
    let key = crate::layout::epoch::claim_key(epoch);
    match tiers.durable.get(&key).await {
        Ok(got) => match got.bytes().await {
            Ok(held) if held == bytes => {
                tiers.writer_epoch.fetch_max(epoch, Ordering::AcqRel);
                epoch
            }
            _ => flushed,
        },
        Err(_) => flushed,
    }
}
