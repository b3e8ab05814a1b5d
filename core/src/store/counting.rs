//! [`CountingStore`]: counts the operations and bytes that pass through a store.
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() {
//! use object_store::{ObjectStoreExt, path::Path};
//! let store = ckpt_core::store::CountingStore::new(ckpt_core::store::memory_store("count-doc"));
//! store.put(&Path::from("a"), vec![0u8; 10].into()).await.unwrap();
//! let n = store.counts();
//! assert_eq!((n.puts, n.put_bytes), (1, 10));
//! # }
//! ```

use std::fmt;
use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use async_trait::async_trait;
use bytes::Bytes;
use futures::stream::BoxStream;
use futures::StreamExt;
use object_store::path::Path;
use object_store::{
    CopyOptions, GetOptions, GetResult, ListResult, MultipartUpload, ObjectMeta, ObjectStore,
    PutMultipartOptions, PutOptions, PutPayload, PutResult, RenameOptions, Result, UploadPart,
};

/// A snapshot of the counters. Subtract two to get the operations in between.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct OpCounts {
    /// Single-request puts.
    pub puts: u64,
    /// Bytes sent by single-request puts.
    pub put_bytes: u64,
    /// Multipart uploads started.
    pub multipart_uploads: u64,
    /// Parts sent.
    pub parts: u64,
    /// Bytes sent in parts.
    pub part_bytes: u64,
    /// Multipart uploads completed.
    pub multipart_completes: u64,
    /// Multipart uploads aborted.
    pub multipart_aborts: u64,
    /// Gets (with a body).
    pub gets: u64,
    /// Bytes returned by gets (the requested range).
    pub get_bytes: u64,
    /// Heads (gets without a body).
    pub heads: u64,
    /// Listings.
    pub lists: u64,
    /// Objects deleted (or asked to be).
    pub deletes: u64,
    /// Copies and renames.
    pub copies: u64,
    /// Operations that returned an error.
    pub errors: u64,
}

impl OpCounts {
    /// Every byte written (puts and parts).
    pub fn written_bytes(&self) -> u64 {
        self.put_bytes + self.part_bytes
    }
}

impl std::ops::Sub for OpCounts {
    type Output = OpCounts;
    fn sub(self, o: OpCounts) -> OpCounts {
        OpCounts {
            puts: self.puts - o.puts,
            put_bytes: self.put_bytes - o.put_bytes,
            multipart_uploads: self.multipart_uploads - o.multipart_uploads,
            parts: self.parts - o.parts,
            part_bytes: self.part_bytes - o.part_bytes,
            multipart_completes: self.multipart_completes - o.multipart_completes,
            multipart_aborts: self.multipart_aborts - o.multipart_aborts,
            gets: self.gets - o.gets,
            get_bytes: self.get_bytes - o.get_bytes,
            heads: self.heads - o.heads,
            lists: self.lists - o.lists,
            deletes: self.deletes - o.deletes,
            copies: self.copies - o.copies,
            errors: self.errors - o.errors,
        }
    }
}

#[derive(Debug, Default)]
struct Counters([AtomicU64; 14]);

// Indices into `Counters`, in the field order of `OpCounts`.
const PUTS: usize = 0;
const PUT_BYTES: usize = 1;
const MP: usize = 2;
const PARTS: usize = 3;
const PART_BYTES: usize = 4;
const MP_DONE: usize = 5;
const MP_ABORT: usize = 6;
const GETS: usize = 7;
const GET_BYTES: usize = 8;
const HEADS: usize = 9;
const LISTS: usize = 10;
const DELETES: usize = 11;
const COPIES: usize = 12;
const ERRORS: usize = 13;

impl Counters {
    fn add(&self, i: usize, v: u64) {
        self.0[i].fetch_add(v, Ordering::Relaxed);
    }

    fn track<T>(&self, r: Result<T>) -> Result<T> {
        if r.is_err() {
            self.add(ERRORS, 1);
        }
        r
    }

    fn snapshot(&self) -> OpCounts {
        let g = |i: usize| self.0[i].load(Ordering::Relaxed);
        OpCounts {
            puts: g(PUTS),
            put_bytes: g(PUT_BYTES),
            multipart_uploads: g(MP),
            parts: g(PARTS),
            part_bytes: g(PART_BYTES),
            multipart_completes: g(MP_DONE),
            multipart_aborts: g(MP_ABORT),
            gets: g(GETS),
            get_bytes: g(GET_BYTES),
            heads: g(HEADS),
            lists: g(LISTS),
            deletes: g(DELETES),
            copies: g(COPIES),
            errors: g(ERRORS),
        }
    }
}

/// Wraps a store and counts what passes through it. Clones share the counters.
#[derive(Debug, Clone)]
pub struct CountingStore {
    inner: Arc<dyn ObjectStore>,
    counters: Arc<Counters>,
}

impl CountingStore {
    /// Count the operations on `inner`.
    pub fn new(inner: Arc<dyn ObjectStore>) -> Self {
        CountingStore {
            inner,
            counters: Arc::default(),
        }
    }

    /// The counts so far.
    pub fn counts(&self) -> OpCounts {
        self.counters.snapshot()
    }
}

impl fmt::Display for CountingStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "CountingStore({})", self.inner)
    }
}

#[async_trait]
impl ObjectStore for CountingStore {
    async fn put_opts(
        &self,
        location: &Path,
        payload: PutPayload,
        opts: PutOptions,
    ) -> Result<PutResult> {
        self.counters.add(PUTS, 1);
        self.counters
            .add(PUT_BYTES, payload.content_length() as u64);
        self.counters
            .track(self.inner.put_opts(location, payload, opts).await)
    }

    async fn put_multipart_opts(
        &self,
        location: &Path,
        opts: PutMultipartOptions,
    ) -> Result<Box<dyn MultipartUpload>> {
        self.counters.add(MP, 1);
        let upload = self
            .counters
            .track(self.inner.put_multipart_opts(location, opts).await)?;
        Ok(Box::new(CountingUpload {
            upload,
            counters: self.counters.clone(),
        }))
    }

    async fn get_opts(&self, location: &Path, options: GetOptions) -> Result<GetResult> {
        let head = options.head;
        let r = self
            .counters
            .track(self.inner.get_opts(location, options).await)?;
        if head {
            self.counters.add(HEADS, 1);
        } else {
            self.counters.add(GETS, 1);
            self.counters.add(GET_BYTES, r.range.end - r.range.start);
        }
        Ok(r)
    }

    async fn get_ranges(&self, location: &Path, ranges: &[Range<u64>]) -> Result<Vec<Bytes>> {
        let r = self
            .counters
            .track(self.inner.get_ranges(location, ranges).await)?;
        self.counters.add(GETS, 1);
        self.counters
            .add(GET_BYTES, r.iter().map(|b| b.len() as u64).sum());
        Ok(r)
    }

    fn delete_stream(
        &self,
        locations: BoxStream<'static, Result<Path>>,
    ) -> BoxStream<'static, Result<Path>> {
        let c = self.counters.clone();
        let c2 = self.counters.clone();
        let counted = locations.inspect(move |_| c.add(DELETES, 1)).boxed();
        self.inner
            .delete_stream(counted)
            .map(move |r| c2.track(r))
            .boxed()
    }

    fn list(&self, prefix: Option<&Path>) -> BoxStream<'static, Result<ObjectMeta>> {
        self.counters.add(LISTS, 1);
        self.inner.list(prefix)
    }

    fn list_with_offset(
        &self,
        prefix: Option<&Path>,
        offset: &Path,
    ) -> BoxStream<'static, Result<ObjectMeta>> {
        self.counters.add(LISTS, 1);
        self.inner.list_with_offset(prefix, offset)
    }

    async fn list_with_delimiter(&self, prefix: Option<&Path>) -> Result<ListResult> {
        self.counters.add(LISTS, 1);
        self.counters
            .track(self.inner.list_with_delimiter(prefix).await)
    }

    async fn copy_opts(&self, from: &Path, to: &Path, options: CopyOptions) -> Result<()> {
        self.counters.add(COPIES, 1);
        self.counters
            .track(self.inner.copy_opts(from, to, options).await)
    }

    async fn rename_opts(&self, from: &Path, to: &Path, options: RenameOptions) -> Result<()> {
        self.counters.add(COPIES, 1);
        self.counters
            .track(self.inner.rename_opts(from, to, options).await)
    }
}

#[derive(Debug)]
struct CountingUpload {
    upload: Box<dyn MultipartUpload>,
    counters: Arc<Counters>,
}

#[async_trait]
impl MultipartUpload for CountingUpload {
    fn put_part(&mut self, data: PutPayload) -> UploadPart {
        self.counters.add(PARTS, 1);
        self.counters.add(PART_BYTES, data.content_length() as u64);
        let fut = self.upload.put_part(data);
        let c = self.counters.clone();
        Box::pin(async move { c.track(fut.await) })
    }

    async fn complete(&mut self) -> Result<PutResult> {
        self.counters.add(MP_DONE, 1);
        self.counters.track(self.upload.complete().await)
    }

    async fn abort(&mut self) -> Result<()> {
        self.counters.add(MP_ABORT, 1);
        self.counters.track(self.upload.abort().await)
    }
}
