//! [`TieredCheckpointStore`]: a fast tier (node-local disk) that the engine writes and
//! commits on, flushed in the background to a durable tier (S3, a shared
//! filesystem) with its own commit there.
//!
//! An engine component, not a store wrapper: it implements `ObjectStore` so that
//! the engine can write through it, but it knows the checkpoint layout. It
//! reads manifests to learn what a checkpoint references, copies checkpoints
//! with the engine's commit order, keeps an index of the durable tier's chunks
//! and applies retention there. The store wrappers in [`crate::store`] know
//! nothing of checkpoints.
//!
//! - **Writes** go to the fast tier only; training waits for nothing else.
//! - **Flush.** Each manifest put on the fast tier queues its checkpoint. A
//!   background task copies the checkpoint's chunks (those the durable tier lacks)
//!   and data objects, and puts the manifest on the durable tier last, so the
//!   durable tier obeys the same protocol as the engine: a checkpoint exists there
//!   only once everything it references is there. Checkpoints flush oldest first.
//!   [`TieredCheckpointStore::flush`] also picks up checkpoints committed on the fast tier by
//!   an earlier process, and waits until the durable tier has all of them.
//! - **Reads** try the fast tier and fall back to the durable one (a wiped fast
//!   tier still loads everything the durable tier holds).
//! - **Listings** are the union of the tiers, so `load_latest` sees the newest
//!   checkpoint committed on either tier and verifies it as usual. One exception:
//!   `chunks/` lists the fast tier only. Chunks are the objects a new save reuses
//!   instead of writing, so a save on the fast tier never depends on a chunk that
//!   only the durable tier holds (whose own retention could delete it).
//! - **Deletes** act on the fast tier only, and the engine's retention is the fast
//!   tier's retention. A delete of an object that a queued flush still needs is
//!   deferred until that flush is done (a later put of the same key cancels it).
//!   The durable tier has its own retention, [`TieredOptions::durable_retention`],
//!   applied after flushes (usually: keep more there).
//!
//! - **Writer epochs** ([`crate::layout::epoch`]): claims are written through
//!   to the durable tier, which decides between claimants, and every flushed
//!   manifest keeps its epoch. Durable retention runs fenced by the newest
//!   epoch flushed, or by the writer's own claim once the durable tier holds
//!   it as put (a restarted writer's first flushes carry the epoch before
//!   it), so a fenced writer's flusher deletes nothing there. A
//!   checkpoint that an old writer committed on its own fast tier but had
//!   not flushed when a new writer claimed does not count on the durable tier.
//!   While the durable tier is down, a claim is made on the fast tier alone
//!   (it then fences only writers that share the fast tier).
//!
//! URL form: `tiered+<fast URL>?durable=<durable URL>[&durable_keep_last=N]`, e.g.
//! `tiered+file:///scratch/run7?durable=s3://bucket/run7&durable_keep_last=20`.
//! [`crate::store::open_url`] opens it, [`crate::store::open_tiered`] too but
//! keeps the type; the builder form is [`TieredCheckpointStore::new`]. Keep the
//! `TieredCheckpointStore` (it is cheap to clone) to call
//! [`TieredCheckpointStore::flush`] before exit.

mod flush;

use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::fmt;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use futures::stream::BoxStream;
use futures::{StreamExt, TryStreamExt};
use object_store::path::Path;
use object_store::{
    CopyOptions, GetOptions, GetResult, ListResult, MultipartUpload, ObjectMeta, ObjectStore,
    ObjectStoreExt, PutMultipartOptions, PutOptions, PutPayload, PutResult, RenameOptions,
    Result as OsResult, UploadPart,
};
use tokio::sync::{Notify, OwnedRwLockReadGuard, RwLock};

use crate::error::{Error, Result};
use crate::layout::chunks::ChunkIndex;
use crate::layout::manifest::Manifest;
use crate::layout::paths::{self, CHUNKS};
use crate::layout::retention::Retention;
use crate::model::CheckpointId;
use crate::sync::MutexExt;

/// URLs of tiered stores start with this.
pub const SCHEME_PREFIX: &str = "tiered+";

/// Options of a [`TieredCheckpointStore`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TieredOptions {
    /// Retention on the durable tier (the engine's retention governs the fast tier).
    pub durable_retention: Retention,
    /// Objects copied at once by the flusher.
    pub concurrency: usize,
    /// Attempts to flush one checkpoint before it is reported as failed (it is
    /// tried again by the next [`TieredCheckpointStore::flush`]).
    pub attempts: u32,
    /// Delay before the second attempt; doubled for each further one.
    pub backoff: Duration,
    /// Objects larger than this are copied to the durable tier in parts.
    pub multipart_threshold: u64,
    /// Durable retention keeps chunks younger than this (another writer's
    /// flush may be copying them).
    pub durable_grace: Duration,
}

impl Default for TieredOptions {
    fn default() -> Self {
        TieredOptions {
            durable_retention: Retention::keep_all(),
            concurrency: 8,
            attempts: 3,
            backoff: Duration::from_millis(100),
            multipart_threshold: 64 << 20,
            durable_grace: Duration::from_secs(60),
        }
    }
}

/// What the flusher did since the last [`TieredCheckpointStore::flush`].
#[derive(Debug, Default)]
pub struct FlushReport {
    /// Checkpoints committed on the durable tier, in order.
    pub flushed: Vec<CheckpointId>,
    /// Checkpoints that could not be flushed, and why. They stay on the fast tier.
    pub failed: Vec<(CheckpointId, Error)>,
}

/// A checkpoint committed on the fast tier and waiting for its flush.
#[derive(Debug)]
pub(crate) struct Pending {
    manifest: Manifest,
    bytes: Bytes,
    chunks: HashSet<String>,
}

impl Pending {
    fn new(manifest: Manifest, bytes: Bytes) -> Self {
        let chunks = manifest.chunk_hashes().map(str::to_owned).collect();
        Pending {
            manifest,
            bytes,
            chunks,
        }
    }

    /// True when flushing this checkpoint reads `key`.
    fn needs(&self, key: &Path) -> bool {
        let id = self.manifest.id();
        if *key == paths::manifest_key(&id) || paths::parse_data_key(key).as_ref() == Some(&id) {
            return true;
        }
        let mut parts = key.parts();
        parts.next().is_some_and(|p| p.as_ref() == CHUNKS)
            && parts
                .next()
                .is_some_and(|h| self.chunks.contains(h.as_ref()))
    }
}

#[derive(Debug, Default)]
pub(crate) struct FlushState {
    queue: BTreeMap<CheckpointId, Arc<Pending>>,
    active: Option<Arc<Pending>>,
    running: bool,
    deferred: HashSet<Path>,
    flushed: Vec<CheckpointId>,
    failed: Vec<(CheckpointId, Error)>,
}

impl FlushState {
    fn needed(&self, key: &Path) -> bool {
        self.active
            .iter()
            .chain(self.queue.values())
            .any(|p| p.needs(key))
    }

    fn idle(&self) -> bool {
        !self.running && self.queue.is_empty() && self.active.is_none()
    }
}

#[derive(Debug)]
pub(crate) struct Tiers {
    fast: Arc<dyn ObjectStore>,
    durable: Arc<dyn ObjectStore>,
    opts: TieredOptions,
    state: Mutex<FlushState>,
    idle: Notify,
    /// Puts hold it shared; running deferred deletes holds it exclusively.
    gate: Arc<RwLock<()>>,
    durable_chunks: tokio::sync::OnceCell<ChunkIndex>,
    /// The newest writer epoch among the manifests flushed, or claimed by
    /// this store's writer and confirmed on the durable tier: durable
    /// retention runs fenced by it (a fenced writer's flusher deletes
    /// nothing there).
    writer_epoch: std::sync::atomic::AtomicU64,
    /// The newest claim this store wrote through to the durable tier, and its
    /// bytes: once the durable tier still holds those bytes under that key,
    /// the claim is this writer's own (see `flush::writer_epoch`).
    claimed: Mutex<Option<(u64, Bytes)>>,
    /// The epochs of the durable tier's manifests its retention has judged.
    durable_epochs: Arc<crate::layout::epoch::ManifestEpochs>,
}

impl Tiers {
    fn lock(&self) -> std::sync::MutexGuard<'_, FlushState> {
        self.state.lock_unpoisoned()
    }

    /// Remember a claim put on the durable tier, if newer than the last.
    fn note_claim(&self, location: &Path, payload: &PutPayload) {
        if let Some(epoch) = crate::layout::epoch::parse_claim_key(location) {
            let mut claimed = self.claimed.lock_unpoisoned();
            if claimed.as_ref().is_none_or(|(e, _)| *e < epoch) {
                let bytes: Bytes = payload.iter().flatten().copied().collect();
                *claimed = Some((epoch, bytes));
            }
        }
    }
}

/// A fast tier flushed to a durable tier. Cheap to clone; clones share the flusher.
#[derive(Debug, Clone)]
pub struct TieredCheckpointStore {
    tiers: Arc<Tiers>,
}

impl TieredCheckpointStore {
    /// Write to `fast`, flush to `durable`.
    pub fn new(
        fast: Arc<dyn ObjectStore>,
        durable: Arc<dyn ObjectStore>,
        opts: TieredOptions,
    ) -> Self {
        let tiers = Tiers {
            fast,
            durable,
            opts,
            state: Mutex::default(),
            idle: Notify::new(),
            gate: Arc::new(RwLock::new(())),
            durable_chunks: tokio::sync::OnceCell::new(),
            writer_epoch: std::sync::atomic::AtomicU64::new(0),
            claimed: Mutex::new(None),
            durable_epochs: Arc::default(),
        };
        TieredCheckpointStore {
            tiers: Arc::new(tiers),
        }
    }

    /// The fast tier.
    pub fn fast(&self) -> &Arc<dyn ObjectStore> {
        &self.tiers.fast
    }

    /// The durable tier.
    pub fn durable(&self) -> &Arc<dyn ObjectStore> {
        &self.tiers.durable
    }

    /// Checkpoints committed on the fast tier whose flush has not finished.
    pub fn pending(&self) -> Vec<CheckpointId> {
        let st = self.tiers.lock();
        st.active
            .iter()
            .map(|p| p.manifest.id())
            .chain(st.queue.keys().cloned())
            .collect()
    }

    /// Queue every checkpoint committed on the fast tier but not on the durable
    /// one (left by an earlier process, or failed), then wait until the flusher is
    /// idle. Returns what was flushed and what failed since the last call.
    pub async fn flush(&self) -> Result<FlushReport> {
        flush::resync(&self.tiers).await?;
        loop {
            let notified = self.tiers.idle.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if self.tiers.lock().idle() {
                break;
            }
            notified.await;
        }
        let mut st = self.tiers.lock();
        Ok(FlushReport {
            flushed: std::mem::take(&mut st.flushed),
            failed: std::mem::take(&mut st.failed),
        })
    }
}

/// The parts of a `tiered+<fast URL>?durable=<durable URL>[&durable_keep_last=N]
/// [&durable_keep_every=N]` URL. [`crate::store::open_tiered`] opens it.
#[derive(Debug, Clone)]
pub struct TieredUrl {
    /// The fast tier's URL.
    pub fast: String,
    /// The durable tier's URL.
    pub durable: String,
    /// The options the URL sets (the rest are defaults).
    pub options: TieredOptions,
}

impl TieredUrl {
    /// Parse a tiered URL.
    pub fn parse(url: &str) -> Result<TieredUrl> {
        let bad = |why: &str| Error::InvalidInput(format!("bad tiered URL `{url}`: {why}"));
        let rest = url
            .strip_prefix(SCHEME_PREFIX)
            .ok_or_else(|| bad("it must start with tiered+"))?;
        let (fast, query) = rest
            .split_once("?durable=")
            .ok_or_else(|| bad("no ?durable=<URL>"))?;
        let mut parts = query.split('&');
        let durable = parts.next().unwrap_or_default();
        let mut opts = TieredOptions::default();
        for p in parts {
            match p.split_once('=') {
                Some(("durable_keep_last", n)) => {
                    let n: usize = n
                        .parse()
                        .map_err(|_| bad("durable_keep_last is not a number"))?;
                    opts.durable_retention.keep_last = Some(n);
                }
                Some(("durable_keep_every", n)) => {
                    let n: u64 = n
                        .parse()
                        .map_err(|_| bad("durable_keep_every is not a number"))?;
                    opts.durable_retention.keep_every = Some(n);
                }
                _ => return Err(bad(&format!("unknown option `{p}`"))),
            }
        }
        if fast.is_empty() || durable.is_empty() {
            return Err(bad("both a fast and a durable URL are needed"));
        }
        if fast == durable {
            return Err(bad("the fast and durable tiers are the same URL"));
        }
        Ok(TieredUrl {
            fast: fast.to_owned(),
            durable: durable.to_owned(),
            options: opts,
        })
    }
}

impl fmt::Display for TieredCheckpointStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "TieredCheckpointStore(fast: {}, durable: {})",
            self.tiers.fast, self.tiers.durable
        )
    }
}

fn is_chunk_listing(prefix: Option<&Path>) -> bool {
    prefix
        .and_then(|p| p.parts().next())
        .is_some_and(|p| p.as_ref() == CHUNKS)
}

fn under_epochs(key: &Path) -> bool {
    key.parts()
        .next()
        .is_some_and(|p| p.as_ref() == crate::layout::epoch::EPOCHS)
}

/// Attendance marks ([`crate::coord::RollCall`]) live on the durable tier
/// only: it is the one the job's nodes share.
fn under_attendance(key: &Path) -> bool {
    key.parts()
        .next()
        .is_some_and(|p| p.as_ref() == paths::ATTENDANCE)
}

fn under_chunks(key: &Path) -> bool {
    key.parts().next().is_some_and(|p| p.as_ref() == CHUNKS)
}

/// A listing that fails because the tier's root does not exist is an empty listing.
fn tolerate_missing<T>(r: OsResult<Vec<T>>) -> OsResult<Vec<T>> {
    match r {
        Err(object_store::Error::NotFound { .. }) => Ok(Vec::new()),
        r => r,
    }
}

#[async_trait]
impl ObjectStore for TieredCheckpointStore {
    async fn put_opts(
        &self,
        location: &Path,
        payload: PutPayload,
        opts: PutOptions,
    ) -> OsResult<PutResult> {
        if under_epochs(location) {
            // Epoch claims are written through: the durable tier decides who
            // wins (a replacement node's fast tier is empty), the fast tier
            // keeps a copy for reads. With the durable tier down, training
            // goes on: the claim is made on the fast tier alone, and fences
            // only writers that share it.
            return match self
                .tiers
                .durable
                .put_opts(location, payload.clone(), opts.clone())
                .await
            {
                Ok(r) => {
                    self.tiers.note_claim(location, &payload);
                    let _ = self.tiers.fast.put(location, payload).await;
                    Ok(r)
                }
                Err(e @ object_store::Error::AlreadyExists { .. }) => Err(e),
                Err(e) => {
                    tracing::warn!(
                        "epoch claim `{location}` could not reach the durable tier ({e}); \
                         claimed on the fast tier only"
                    );
                    self.tiers.fast.put_opts(location, payload, opts).await
                }
            };
        }
        if under_attendance(location) {
            return self.tiers.durable.put_opts(location, payload, opts).await;
        }
        let manifest_id = paths::parse_manifest_key(location);
        let bytes: Option<Bytes> = manifest_id
            .as_ref()
            .map(|_| payload.iter().flatten().copied().collect());
        let gate = self.tiers.gate.read().await;
        self.tiers.lock().deferred.remove(location);
        let r = self.tiers.fast.put_opts(location, payload, opts).await?;
        drop(gate);
        if let (Some(id), Some(bytes)) = (manifest_id, bytes) {
            match Manifest::decode(&bytes, location.as_ref()) {
                // A root's fragments are on the fast tier already (written
                // before it): what it references is read from them.
                Ok(m) if m.id() == id => {
                    match crate::layout::catalog::expand(self.tiers.fast.as_ref(), m, None).await {
                        Ok(m) => flush::enqueue(&self.tiers, Pending::new(m, bytes)),
                        Err(e) => tracing::warn!(
                            "`{location}`'s fragments could not be read ({e}); it is not flushed"
                        ),
                    }
                }
                Ok(_) | Err(_) => {
                    tracing::warn!("`{location}` is not a valid manifest; it is not flushed")
                }
            }
        }
        Ok(r)
    }

    async fn put_multipart_opts(
        &self,
        location: &Path,
        opts: PutMultipartOptions,
    ) -> OsResult<Box<dyn MultipartUpload>> {
        let gate = self.tiers.gate.clone().read_owned().await;
        self.tiers.lock().deferred.remove(location);
        let upload = self.tiers.fast.put_multipart_opts(location, opts).await?;
        Ok(Box::new(GatedUpload {
            upload,
            _gate: gate,
        }))
    }

    async fn get_opts(&self, location: &Path, options: GetOptions) -> OsResult<GetResult> {
        match self.tiers.fast.get_opts(location, options.clone()).await {
            Err(object_store::Error::NotFound { .. }) => {
                self.tiers.durable.get_opts(location, options).await
            }
            r => r,
        }
    }

    fn delete_stream(
        &self,
        locations: BoxStream<'static, OsResult<Path>>,
    ) -> BoxStream<'static, OsResult<Path>> {
        let tiers = self.tiers.clone();
        locations
            .then(move |loc| {
                let tiers = tiers.clone();
                async move {
                    let loc = loc?;
                    if under_attendance(&loc) {
                        return tiers.durable.delete(&loc).await.map(|()| loc);
                    }
                    {
                        let mut st = tiers.lock();
                        if st.needed(&loc) {
                            st.deferred.insert(loc.clone());
                            return Ok(loc);
                        }
                    }
                    tiers.fast.delete(&loc).await.map(|()| loc)
                }
            })
            .boxed()
    }

    fn list(&self, prefix: Option<&Path>) -> BoxStream<'static, OsResult<ObjectMeta>> {
        let tiers = self.tiers.clone();
        let prefix = prefix.cloned();
        futures::stream::once(async move {
            let fast = tolerate_missing(tiers.fast.list(prefix.as_ref()).try_collect().await)?;
            let mut by_key: BTreeMap<Path, ObjectMeta> =
                fast.into_iter().map(|m| (m.location.clone(), m)).collect();
            if !is_chunk_listing(prefix.as_ref()) {
                let durable: Vec<ObjectMeta> =
                    tiers.durable.list(prefix.as_ref()).try_collect().await?;
                for m in durable.into_iter().filter(|m| !under_chunks(&m.location)) {
                    by_key.entry(m.location.clone()).or_insert(m);
                }
            }
            Ok::<_, object_store::Error>(futures::stream::iter(by_key.into_values().map(Ok)))
        })
        .try_flatten()
        .boxed()
    }

    async fn list_with_delimiter(&self, prefix: Option<&Path>) -> OsResult<ListResult> {
        let fast = match self.tiers.fast.list_with_delimiter(prefix).await {
            Err(object_store::Error::NotFound { .. }) => ListResult {
                common_prefixes: Vec::new(),
                objects: Vec::new(),
                extensions: Default::default(),
            },
            r => r?,
        };
        if is_chunk_listing(prefix) {
            return Ok(fast);
        }
        let durable = self.tiers.durable.list_with_delimiter(prefix).await?;
        let mut dirs: BTreeSet<Path> = fast.common_prefixes.into_iter().collect();
        dirs.extend(durable.common_prefixes);
        let mut objects: BTreeMap<Path, ObjectMeta> = fast
            .objects
            .into_iter()
            .map(|m| (m.location.clone(), m))
            .collect();
        for m in durable
            .objects
            .into_iter()
            .filter(|m| !under_chunks(&m.location))
        {
            objects.entry(m.location.clone()).or_insert(m);
        }
        Ok(ListResult {
            common_prefixes: dirs.into_iter().collect(),
            objects: objects.into_values().collect(),
            extensions: fast.extensions,
        })
    }

    async fn copy_opts(&self, from: &Path, to: &Path, options: CopyOptions) -> OsResult<()> {
        self.tiers.fast.copy_opts(from, to, options).await
    }

    async fn rename_opts(&self, from: &Path, to: &Path, options: RenameOptions) -> OsResult<()> {
        self.tiers.fast.rename_opts(from, to, options).await
    }
}

/// A multipart upload to the fast tier; holds the put gate until it is dropped.
#[derive(Debug)]
struct GatedUpload {
    upload: Box<dyn MultipartUpload>,
    _gate: OwnedRwLockReadGuard<()>,
}

#[async_trait]
impl MultipartUpload for GatedUpload {
    fn put_part(&mut self, data: PutPayload) -> UploadPart {
        self.upload.put_part(data)
    }

    async fn complete(&mut self) -> OsResult<PutResult> {
        self.upload.complete().await
    }

    async fn abort(&mut self) -> OsResult<()> {
        self.upload.abort().await
    }
}
