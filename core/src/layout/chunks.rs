//! The set of content-addressed chunks known to be durably stored.
//!
//! A save consults it to skip chunks that are already there (incremental
//! checkpoints). Only chunks whose write completed, that a committed
//! checkpoint references, or that a listing found, are in it; a chunk is
//! forgotten when a load finds it corrupt or GC deletes it, so the next save
//! writes it again.
//!
//! A checkpointer does not list `chunks/` when it opens: its first save
//! seeds the index from the newest committed checkpoint's records of this
//! rank ([`seed`]), the chunks it is likely to reuse, known to exist because
//! that checkpoint is committed and GC keeps what a kept one references.

use std::collections::HashMap;
use std::future::Future;
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use futures::future::{BoxFuture, Shared};
use futures::FutureExt;

use futures::TryStreamExt;
use object_store::path::Path;
use object_store::ObjectStore;

use crate::error::{Error, Result};
use crate::layout::manifest::is_hash;
use crate::layout::paths::CHUNKS;
use crate::model::CheckpointId;
use crate::sync::MutexExt;

/// Known chunk hashes (hex), with their stored sizes.
#[derive(Debug, Default)]
pub struct ChunkIndex {
    present: Mutex<HashMap<String, u64>>,
    seeded: std::sync::atomic::AtomicBool,
    /// The chunks this rank's records of each checkpoint reference, so that
    /// it forgets those of a retired one without being sent what GC deleted.
    notes: Mutex<HashMap<CheckpointId, Vec<String>>>,
}

impl ChunkIndex {
    /// An empty index (nothing is reused until chunks are written).
    pub fn new() -> Self {
        Self::default()
    }

    /// Build the index from one listing of `chunks/`.
    pub async fn scan(store: &dyn ObjectStore) -> Result<Self> {
        let prefix = Path::from(CHUNKS);
        let metas: Vec<_> = store.list(Some(&prefix)).try_collect().await?;
        let set = metas
            .into_iter()
            .filter_map(|m| {
                let name = m.location.filename().filter(|f| is_hash(f))?;
                Some((name.to_owned(), m.size))
            })
            .collect();
        Ok(ChunkIndex {
            present: Mutex::new(set),
            seeded: true.into(),
            notes: Default::default(),
        })
    }

    /// Remember that this rank's records of `id` reference `hashes`.
    pub fn note(&self, id: &CheckpointId, hashes: Vec<String>) {
        self.notes.lock_unpoisoned().insert(id.clone(), hashes);
    }

    /// Checkpoints were retired: forget the chunks this rank's records of
    /// them referenced that none of its other noted checkpoints does (GC may
    /// have deleted them; one another rank still uses is written again).
    pub fn retire(&self, ids: &[CheckpointId]) {
        let mut notes = self.notes.lock_unpoisoned();
        let gone: Vec<String> = ids
            .iter()
            .filter_map(|id| notes.remove(id))
            .flatten()
            .collect();
        if gone.is_empty() {
            return;
        }
        let kept: std::collections::HashSet<&str> =
            notes.values().flatten().map(String::as_str).collect();
        let mut present = self.lock();
        for h in gone.iter().filter(|h| !kept.contains(h.as_str())) {
            present.remove(h);
        }
    }

    /// Forget everything (a full sweep deleted what nothing references):
    /// the next save seeds the index again.
    pub fn forget_all(&self) {
        self.lock().clear();
        self.notes.lock_unpoisoned().clear();
        self.seeded
            .store(false, std::sync::atomic::Ordering::Release);
    }

    /// Seed the index once ([`seed`]); with `again`, replace what it knows
    /// by a new seeding (after a writer epoch was claimed: an older writer
    /// may have deleted chunks since).
    pub async fn seed_once(&self, store: &dyn ObjectStore, rank: u32, again: bool) {
        use std::sync::atomic::Ordering;
        if self.seeded.swap(true, Ordering::AcqRel) && !again {
            return;
        }
        let known = match seed(store, rank).await {
            Ok(Some((id, k))) => {
                self.note(&id, k.keys().cloned().collect());
                k
            }
            Ok(None) => HashMap::new(),
            Err(e) => {
                tracing::info!("chunk index not seeded ({e}); this save writes every chunk");
                HashMap::new()
            }
        };
        let mut present = self.lock();
        if again {
            *present = known;
        } else {
            present.extend(known);
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, u64>> {
        self.present.lock_unpoisoned()
    }

    /// The stored size of this chunk, if it is known to be stored.
    pub fn get(&self, hash: &str) -> Option<u64> {
        self.lock().get(hash).copied()
    }

    /// Record a chunk as durably stored, with its stored size.
    pub fn insert(&self, hash: String, stored: u64) {
        self.lock().insert(hash, stored);
    }

    /// Forget a chunk (deleted, or found corrupt).
    pub fn remove(&self, hash: &str) {
        self.lock().remove(hash);
    }

    /// Number of known chunks.
    pub fn len(&self) -> usize {
        self.lock().len()
    }

    /// True when no chunk is known.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// The chunks rank `rank`'s records of the newest committed checkpoint
/// reference (its fragment, or the manifest that holds every record), with
/// their stored sizes. Reads `manifests/`'s listing, one manifest and at
/// most one fragment.
pub async fn seed(
    store: &dyn ObjectStore,
    rank: u32,
) -> Result<Option<(CheckpointId, HashMap<String, u64>)>> {
    let Some(id) = crate::layout::catalog::committed(store).await?.pop() else {
        return Ok(None);
    };
    let root = crate::layout::catalog::read_manifest(store, &id).await?;
    let only = std::collections::BTreeSet::from([rank]);
    let m = crate::layout::catalog::expand(store, root, Some(&only)).await?;
    let mut out = HashMap::new();
    for t in &m.tensors {
        if let crate::layout::manifest::Layout::Chunks { chunks } = &t.layout {
            out.extend(chunks.iter().map(|c| (c.hash.clone(), c.stored)));
        }
    }
    Ok(Some((id, out)))
}

type Fetch = Shared<BoxFuture<'static, std::result::Result<Bytes, Arc<Error>>>>;

/// Decoded chunks kept for the length of one load, so a chunk that several small
/// tensors share is fetched and verified once, however many of them are read.
#[derive(Default)]
pub struct ChunkCache {
    fetches: Mutex<HashMap<String, Fetch>>,
}

impl std::fmt::Debug for ChunkCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let n = self.fetches.lock().map(|m| m.len()).unwrap_or(0);
        write!(f, "ChunkCache({n} chunks)")
    }
}

impl ChunkCache {
    /// An empty cache.
    pub fn new() -> Self {
        Self::default()
    }

    /// The decoded chunk `hash`, from `load` the first time it is asked for.
    /// Concurrent askers share one fetch; an error is returned to all of them.
    pub async fn get_or_load<F>(&self, hash: &str, load: F) -> Result<Bytes>
    where
        F: Future<Output = Result<Bytes>> + Send + 'static,
    {
        let fetch = {
            let mut map = self.fetches.lock_unpoisoned();
            map.entry(hash.to_owned())
                .or_insert_with(|| async move { load.await.map_err(Arc::new) }.boxed().shared())
                .clone()
        };
        fetch.await.map_err(|e| e.duplicate())
    }
}
