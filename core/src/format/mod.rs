//! The small trait where formats and the engine meet.
//!
//! The engine owns the commit protocol, hashing policy and retention; a [`Format`]
//! only decides how tensor bytes are laid out in objects. Formats live in the
//! `ckpt-formats` crate; the engine reaches them through `Arc<dyn Format>` and a
//! [`FormatRegistry`] (so a checkpoint written in any format can be loaded).
//!
//! - this file: the [`Format`] trait and the contexts it is given
//!   ([`WriteContext`], [`ReadContext`]);
//! - [`io`]: what formats share: [`io::put_object`], verified ranged reads
//!   ([`io::read_range`]) and the trait's default read paths;
//! - `ranges`: the tensors of single-file formats read with coalesced ranged
//!   reads (on a remote store);
//! - `registry`: [`FormatRegistry`]; `stats`: [`WriteStats`].
//!
//! This module needs nothing of the engine (the checkpointer, save or load):
//! the engine fills the contexts, and every limit a read obeys is a field of
//! its [`ReadContext`].

pub mod io;
pub(crate) mod ranges;
mod registry;
mod stats;

use std::fmt;
use std::sync::Arc;

use async_trait::async_trait;
use bytes::Bytes;
use object_store::path::Path;
use object_store::ObjectStore;

pub use registry::FormatRegistry;
pub use stats::{WriteStats, WriteTotals};

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
    /// Tensors a load works on at once ([`io::read_each`] and the like); their
    /// object reads are bounded separately, by [`ReadContext::fetches`].
    pub tensors_in_flight: usize,
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
    /// Tensors in flight unless the engine says otherwise: enough that the
    /// storage always has reads queued.
    pub const TENSORS_IN_FLIGHT: usize = 256;

    /// A context for reads from `store` with `concurrency` object reads in
    /// flight, a fresh chunk index and cache, and no merged reads.
    pub fn new(store: Arc<dyn ObjectStore>, concurrency: usize) -> Self {
        let concurrency = concurrency.max(1);
        ReadContext {
            store,
            chunks: Arc::new(ChunkIndex::new()),
            cache: Arc::new(ChunkCache::new()),
            concurrency,
            tensors_in_flight: Self::TENSORS_IN_FLIGHT,
            fetches: Arc::new(tokio::sync::Semaphore::new(concurrency)),
            coalesce_bytes: 0,
        }
    }

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

    /// Does [`Format::finish`] use the records? In a job of several ranks
    /// rank 0 then reads every rank's fragment back to pass them (formats
    /// that write an index file); otherwise it passes none.
    fn finish_reads_records(&self) -> bool {
        false
    }

    /// Read one tensor's bytes, verified against the manifest's hashes.
    ///
    /// The default handles [`Layout::Range`], which suits every single-file format.
    async fn read(&self, ctx: &ReadContext, record: &TensorRecord) -> Result<Bytes> {
        io::read_range(ctx, record).await
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
    /// once ([`io::read_each`]); where [`ReadContext::coalesce_bytes`] allows (a
    /// remote store), it reads the [`Layout::Range`] tensors as the default
    /// `read` would, but with neighbours in one object merged into one ranged
    /// read. A format that overrides `read` for ranges overrides this too.
    async fn read_many(
        &self,
        ctx: &ReadContext,
        records: Vec<&TensorRecord>,
    ) -> Result<Vec<Bytes>> {
        if ctx.coalesce_bytes == 0 {
            return io::read_each(self, ctx, records).await;
        }
        let (ranged, other): (Vec<_>, Vec<_>) = records
            .iter()
            .copied()
            .enumerate()
            .partition(|(_, r)| merged_range(r));
        let (ranged_at, ranged): (Vec<usize>, Vec<&TensorRecord>) = ranged.into_iter().unzip();
        let (other_at, other): (Vec<usize>, Vec<&TensorRecord>) = other.into_iter().unzip();
        let (a, b) = futures::try_join!(
            ranges::read_coalesced(ctx, &ranged),
            io::read_each(self, ctx, other)
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
    /// [`Format::read_into`] on many tensors at once ([`io::read_each_into`]), and
    /// merges the reads of [`Layout::Range`] tensors where
    /// [`ReadContext::coalesce_bytes`] allows, as [`Format::read_many`] does; a
    /// format overrides it to plan the reads of the whole batch.
    async fn read_many_into(
        &self,
        ctx: &ReadContext,
        targets: Vec<(&TensorRecord, &mut [u8])>,
    ) -> Result<()> {
        if ctx.coalesce_bytes == 0 {
            return io::read_each_into(self, ctx, targets).await;
        }
        // Where reads are merged, the ranges come in merged reads and are
        // copied into their buffers; the rest go one by one.
        let (ranged, other): (Vec<_>, Vec<_>) =
            targets.into_iter().partition(|(r, _)| merged_range(r));
        let records: Vec<&TensorRecord> = ranged.iter().map(|(r, _)| *r).collect();
        let mut dsts: Vec<&mut [u8]> = ranged.into_iter().map(|(_, d)| d).collect();
        // Each tensor is copied in as its span arrives, so the spans in flight
        // are all the memory this holds.
        let fill = ranges::for_each_span(ctx, &records, |i, data| {
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
        futures::try_join!(fill, io::read_each_into(self, ctx, other)).map(drop)
    }
}

/// Whether `record` is read in a merged ranged read where reads are merged: a
/// non-empty [`Layout::Range`] (an empty one is checked with a HEAD, as
/// [`io::read_range`] does).
fn merged_range(record: &TensorRecord) -> bool {
    matches!(&record.layout, Layout::Range { len, .. } if *len > 0)
}
