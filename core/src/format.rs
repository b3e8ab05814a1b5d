//! The small trait where formats and the engine meet.
//!
//! The engine owns the commit protocol, hashing policy and retention; a [`Format`]
//! only decides how tensor bytes are laid out in objects. Formats live in the
//! `ckpt-formats` crate; the engine reaches them through `Arc<dyn Format>` and a
//! [`FormatRegistry`] (so a checkpoint written in any format can be loaded).

use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use async_trait::async_trait;
use bytes::Bytes;
use futures::{StreamExt, TryStreamExt};
use object_store::path::Path;
use object_store::{ObjectStore, ObjectStoreExt, PutPayload};

use crate::error::{Error, Result};
use crate::layout::chunks::{ChunkCache, ChunkIndex};
use crate::layout::manifest::{Layout, TensorRecord};
use crate::model::tensor::Tensor;

/// Compression of stored bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum Compression {
    /// Store raw bytes.
    #[default]
    None,
    /// zstd at the given level (1..=22; 1 to 3 are fast).
    Zstd(i32),
}

/// How a format writes: options shared by every format.
#[derive(Debug, Clone)]
pub struct WriteOptions {
    /// Chunk size in bytes for chunked formats.
    pub chunk_size: usize,
    /// Compression for formats that support it.
    pub compression: Compression,
    /// Maximum number of objects written (or chunks encoded) at once.
    pub concurrency: usize,
    /// Objects larger than this are uploaded in parts.
    pub multipart_threshold: usize,
}

impl Default for WriteOptions {
    fn default() -> Self {
        WriteOptions {
            chunk_size: 8 << 20,
            compression: Compression::None,
            concurrency: 8,
            multipart_threshold: 64 << 20,
        }
    }
}

/// Counters a format fills in while it writes; the engine turns them into a report.
#[derive(Debug, Default)]
pub struct WriteStats {
    /// Raw tensor bytes handled.
    pub raw_bytes: AtomicU64,
    /// Bytes of objects written to storage.
    pub stored_bytes: AtomicU64,
    /// Raw bytes not written because an identical chunk was already stored.
    pub reused_bytes: AtomicU64,
    /// Objects written.
    pub objects: AtomicU64,
    /// Nanoseconds spent hashing (summed over tasks).
    pub hash_ns: AtomicU64,
    /// Nanoseconds spent compressing/encoding (summed over tasks).
    pub encode_ns: AtomicU64,
    /// Nanoseconds spent in storage writes (summed over tasks).
    pub write_ns: AtomicU64,
}

impl WriteStats {
    /// Add to a counter.
    pub fn add(counter: &AtomicU64, v: u64) {
        counter.fetch_add(v, Ordering::Relaxed);
    }
}

/// Everything a format needs to write one checkpoint's tensors.
#[derive(Debug, Clone)]
pub struct WriteContext {
    /// The store, rooted at the checkpoint root.
    pub store: Arc<dyn ObjectStore>,
    /// Prefix for this checkpoint's own objects (`data/<name>`).
    pub data_prefix: Path,
    /// Rank writing (0 in a single process).
    pub rank: usize,
    /// Number of ranks writing this checkpoint.
    pub world_size: usize,
    /// The checkpoint's non-tensor state (formats that can hold it, e.g. `.pt`
    /// files or safetensors metadata, store a copy; the manifest always has it).
    pub meta: crate::model::value::Value,
    /// Options.
    pub options: WriteOptions,
    /// Chunks known to be durably stored (for content-addressed reuse).
    pub chunks: Arc<ChunkIndex>,
    /// Counters.
    pub stats: Arc<WriteStats>,
}

/// What a format wrote.
#[derive(Debug, Default)]
pub struct WriteOutput {
    /// One record per tensor, in input order.
    pub records: Vec<TensorRecord>,
    /// Per-checkpoint objects written (keys relative to the root).
    pub objects: Vec<String>,
}

/// Everything a format needs to read.
#[derive(Debug, Clone)]
pub struct ReadContext {
    /// The store, rooted at the checkpoint root.
    pub store: Arc<dyn ObjectStore>,
    /// Chunks index, so a chunk found corrupt is forgotten and rewritten by the next save.
    pub chunks: Arc<ChunkIndex>,
    /// Chunks decoded during this load (shared chunks are fetched once).
    pub cache: Arc<ChunkCache>,
    /// Objects (chunks) of one tensor fetched and verified at once.
    pub concurrency: usize,
    /// Object reads in flight across the whole load, shared by every tensor's
    /// reads: the engine keeps many tensors in flight (so the storage always has
    /// work queued, whichever tensors share a packed chunk) and this bounds the
    /// reads, and the buffers they fill, to `load_concurrency`.
    pub fetches: Arc<tokio::sync::Semaphore>,
    /// Largest span of bytes one ranged read may cover when neighbouring
    /// tensors of a single-file format are merged ([`Format::read_many`]); 0
    /// reads each tensor on its own. Merging pays on a remote store, where a
    /// request costs a round trip; on a local disk smaller reads pipeline better.
    pub coalesce_bytes: u64,
}

impl ReadContext {
    /// Wait for a turn to read one object; hold the permit until its bytes are
    /// verified and copied where they go.
    pub async fn fetch_permit(&self) -> Result<tokio::sync::SemaphorePermit<'_>> {
        self.fetches
            .acquire()
            .await
            .map_err(|_| Error::Internal("the load's read limiter was closed".into()))
    }
}

/// An on-storage layout of tensors.
#[async_trait]
pub trait Format: Send + Sync + fmt::Debug {
    /// Name recorded in manifests (`native`, `safetensors`, `hdf5`, `torch`).
    fn name(&self) -> &'static str;

    /// Write `tensors` and describe where each one went.
    async fn write(&self, ctx: &WriteContext, tensors: &[Tensor]) -> Result<WriteOutput>;

    /// Called on rank 0 once every rank's share is written, just before the
    /// manifest: write objects that describe the whole checkpoint (an index over
    /// every rank's files, say). Returns their keys. The default writes nothing.
    async fn finish(&self, _ctx: &WriteContext, _records: &[TensorRecord]) -> Result<Vec<String>> {
        Ok(Vec::new())
    }

    /// Read one tensor's bytes, verified against the manifest's hashes.
    ///
    /// The default handles [`Layout::Range`], which suits every single-file format.
    async fn read(&self, ctx: &ReadContext, record: &TensorRecord) -> Result<Bytes> {
        read_range(ctx, record).await
    }

    /// Read one tensor's bytes into `dst` (exactly the tensor's length), verified.
    ///
    /// The default reads and copies; formats override it to decode in place.
    async fn read_into(
        &self,
        ctx: &ReadContext,
        record: &TensorRecord,
        dst: &mut [u8],
    ) -> Result<()> {
        let data = self.read(ctx, record).await?;
        if data.len() != dst.len() {
            return Err(Error::InvalidInput(format!(
                "tensor `{}` has {} bytes, the buffer {}",
                record.name,
                data.len(),
                dst.len()
            )));
        }
        dst.copy_from_slice(&data);
        Ok(())
    }

    /// Read many tensors' bytes, in the order given, each verified; an error
    /// names its tensor. The default runs [`Format::read`] on many tensors at
    /// once ([`read_each`]); where [`ReadContext::coalesce_bytes`] allows (a
    /// remote store), it reads the [`Layout::Range`] tensors as the default
    /// `read` would, but with neighbours in one object merged into one ranged
    /// read. A format that overrides `read` for ranges overrides this too.
    async fn read_many(
        &self,
        ctx: &ReadContext,
        records: Vec<&TensorRecord>,
    ) -> Result<Vec<Bytes>> {
        if ctx.coalesce_bytes == 0 {
            return read_each(self, ctx, records).await;
        }
        let (ranged, other): (Vec<_>, Vec<_>) = records
            .iter()
            .copied()
            .enumerate()
            .partition(|(_, r)| merged_range(r));
        let (ranged_at, ranged): (Vec<usize>, Vec<&TensorRecord>) = ranged.into_iter().unzip();
        let (other_at, other): (Vec<usize>, Vec<&TensorRecord>) = other.into_iter().unzip();
        let (a, b) = futures::try_join!(
            crate::load::ranges::read_coalesced(ctx, &ranged),
            read_each(self, ctx, other)
        )?;
        let mut out = vec![Bytes::new(); records.len()];
        for (i, data) in ranged_at
            .into_iter()
            .zip(a)
            .chain(other_at.into_iter().zip(b))
        {
            out[i] = data;
        }
        Ok(out)
    }

    /// Read many tensors, each into its buffer (exactly the tensor's length),
    /// verified; an error names its tensor. The default runs
    /// [`Format::read_into`] on many tensors at once ([`read_each_into`]), and
    /// merges the reads of [`Layout::Range`] tensors where
    /// [`ReadContext::coalesce_bytes`] allows, as [`Format::read_many`] does; a
    /// format overrides it to plan the reads of the whole batch.
    async fn read_many_into(
        &self,
        ctx: &ReadContext,
        targets: Vec<(&TensorRecord, &mut [u8])>,
    ) -> Result<()> {
        if ctx.coalesce_bytes == 0 {
            return read_each_into(self, ctx, targets).await;
        }
        // Where reads are merged, the ranges come in merged reads and are
        // copied into their buffers; the rest go one by one.
        let (ranged, other): (Vec<_>, Vec<_>) =
            targets.into_iter().partition(|(r, _)| merged_range(r));
        let records: Vec<&TensorRecord> = ranged.iter().map(|(r, _)| *r).collect();
        let mut dsts: Vec<&mut [u8]> = ranged.into_iter().map(|(_, d)| d).collect();
        // Each tensor is copied in as its span arrives, so the spans in flight
        // are all the memory this holds.
        let fill = crate::load::ranges::for_each_span(ctx, &records, |i, data| {
            let dst = &mut dsts[i];
            if data.len() != dst.len() {
                return Err(Error::InvalidInput(format!(
                    "tensor `{}` has {} bytes, the buffer {}",
                    records[i].name,
                    data.len(),
                    dst.len()
                )));
            }
            dst.copy_from_slice(&data);
            Ok(())
        });
        futures::try_join!(fill, read_each_into(self, ctx, other)).map(drop)
    }
}

/// Whether `record` is read in a merged ranged read where reads are merged: a
/// non-empty [`Layout::Range`] (an empty one is checked with a HEAD, as
/// [`read_range`] does).
fn merged_range(record: &TensorRecord) -> bool {
    matches!(&record.layout, Layout::Range { len, .. } if *len > 0)
}

/// [`Format::read`] on each record, many tensors in flight, results in order.
pub async fn read_each<F: Format + ?Sized>(
    format: &F,
    ctx: &ReadContext,
    records: Vec<&TensorRecord>,
) -> Result<Vec<Bytes>> {
    let reads: Vec<_> = records
        .into_iter()
        .map(|r| async move {
            format
                .read(ctx, r)
                .await
                .map_err(|e| e.with_tensor(&r.name))
        })
        .collect();
    futures::stream::iter(reads)
        .buffered(crate::load::read::TENSORS_IN_FLIGHT)
        .try_collect()
        .await
}

/// [`Format::read_into`] on each target, many tensors in flight: the storage
/// always has reads queued (bounded by [`ReadContext::fetches`]), even while a
/// run of small tensors waits on the one packed chunk they share.
pub async fn read_each_into<F: Format + ?Sized>(
    format: &F,
    ctx: &ReadContext,
    targets: Vec<(&TensorRecord, &mut [u8])>,
) -> Result<()> {
    let reads: Vec<_> = targets
        .into_iter()
        .map(|(r, dst)| async move {
            format
                .read_into(ctx, r, dst)
                .await
                .map_err(|e| e.with_tensor(&r.name))
        })
        .collect();
    futures::stream::iter(reads)
        .buffer_unordered(crate::load::read::TENSORS_IN_FLIGHT)
        .try_collect::<Vec<()>>()
        .await
        .map(drop)
}

/// Read a [`Layout::Range`] tensor and verify its blake3.
pub async fn read_range(ctx: &ReadContext, record: &TensorRecord) -> Result<Bytes> {
    let Layout::Range {
        object,
        offset,
        len,
        blake3: want,
    } = &record.layout
    else {
        return Err(Error::Unsupported(format!(
            "tensor `{}`: this format cannot read a chunked layout",
            record.name
        )));
    };
    let end = offset
        .checked_add(*len)
        .ok_or_else(|| Error::corrupt(object.as_str(), Some(&record.name), "range overflows"))?;
    let _permit = ctx.fetch_permit().await?;
    let data = if *len == 0 {
        ctx.store
            .head(&Path::from(object.as_str()))
            .await
            .map_err(|e| storage_err(e, object, &record.name))?;
        Bytes::new()
    } else {
        match ctx
            .store
            .get_range(&Path::from(object.as_str()), *offset..end)
            .await
        {
            Ok(b) => b,
            Err(e) => return Err(range_error(ctx, e, object, &record.name, end).await),
        }
    };
    if data.len() as u64 != *len {
        return Err(Error::corrupt(
            object.as_str(),
            Some(&record.name),
            format!("object is truncated: got {} of {len} bytes", data.len()),
        ));
    }
    let data2 = data.clone();
    let got = crate::budget::run_cpu(move || blake3::hash(&data2)).await?;
    if got.to_hex().as_str() != want {
        return Err(Error::corrupt(
            object.as_str(),
            Some(&record.name),
            "blake3 mismatch",
        ));
    }
    Ok(data)
}

/// Map a storage error on a known object to a typed ckpt error: a missing object
/// is corruption of the checkpoint, anything else a storage failure (which
/// `load_latest` does not skip past). Truncation is detected by length checks
/// and by [`range_error`], never by an error message.
pub fn storage_err(e: object_store::Error, object: &str, tensor: &str) -> Error {
    match e {
        object_store::Error::NotFound { .. } => {
            Error::corrupt(object, Some(tensor), "object is missing")
        }
        other => Error::Storage(other),
    }
}

/// A ranged read failed: if the object is now shorter than the range, it was
/// truncated (corruption); otherwise the error is the store's.
async fn range_error(
    ctx: &ReadContext,
    e: object_store::Error,
    object: &str,
    tensor: &str,
    end: u64,
) -> Error {
    if matches!(e, object_store::Error::NotFound { .. }) {
        return storage_err(e, object, tensor);
    }
    match ctx.store.head(&Path::from(object)).await {
        Ok(meta) if meta.size < end => Error::corrupt(
            object,
            Some(tensor),
            format!(
                "object is truncated: {} bytes, the tensor ends at {end}",
                meta.size
            ),
        ),
        _ => Error::Storage(e),
    }
}

/// Write one object, in parts when it is large. The parts are sent as they are (no copy).
pub async fn put_object(ctx: &WriteContext, key: &Path, parts: Vec<Bytes>) -> Result<u64> {
    let total: u64 = parts.iter().map(|p| p.len() as u64).sum();
    let start = std::time::Instant::now();
    if total as usize > ctx.options.multipart_threshold {
        let upload = ctx.store.put_multipart(key).await?;
        let mut w = object_store::WriteMultipart::new_with_chunk_size(upload, 16 << 20);
        for p in parts {
            w.wait_for_capacity(ctx.options.concurrency.max(1)).await?;
            w.put(p);
        }
        w.finish().await?;
    } else {
        ctx.store.put(key, PutPayload::from_iter(parts)).await?;
    }
    WriteStats::add(&ctx.stats.write_ns, start.elapsed().as_nanos() as u64);
    WriteStats::add(&ctx.stats.stored_bytes, total);
    WriteStats::add(&ctx.stats.objects, 1);
    crate::failpoint::hit("save.mid_data").await?;
    Ok(total)
}

/// Formats by name, for loading checkpoints written in any of them.
#[derive(Debug, Clone, Default)]
pub struct FormatRegistry {
    formats: HashMap<String, Arc<dyn Format>>,
}

impl FormatRegistry {
    /// An empty registry.
    pub fn new() -> Self {
        Self::default()
    }

    /// Register a format under its name (replacing one of the same name).
    pub fn register(&mut self, format: Arc<dyn Format>) -> &mut Self {
        self.formats.insert(format.name().to_owned(), format);
        self
    }

    /// Look a format up by name.
    pub fn get(&self, name: &str) -> Result<Arc<dyn Format>> {
        self.formats
            .get(name)
            .cloned()
            .ok_or_else(|| Error::Unsupported(format!("no reader registered for format `{name}`")))
    }

    /// Names of the registered formats.
    pub fn names(&self) -> Vec<&str> {
        let mut v: Vec<&str> = self.formats.keys().map(String::as_str).collect();
        v.sort_unstable();
        v
    }
}
