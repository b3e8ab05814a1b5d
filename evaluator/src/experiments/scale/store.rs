//! One simulated rank's view of the shared store: every request counted by
//! core's [`CountingStore`], in two counters split by key, data (`chunks/`)
//! and metadata (everything else: manifests, epoch claims, and whatever else
//! a format or the commit keeps beside the chunks), so that "metadata bytes a
//! loading rank reads" is the metadata counter's get bytes during a load.
//! The counts at the last put under `manifests/` (a commit's publication)
//! are kept, so that what the commit did after it (its fence check,
//! retention and GC) can be told apart. Listings are counted by the objects
//! they return too: a list request's cost grows with them.

use std::fmt;
use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use bytes::Bytes;
use ckpt_core::store::{CountingStore, OpCounts};
use ckpt_core::sync::MutexExt;
use futures::stream::BoxStream;
use futures::{StreamExt, TryStreamExt};
use object_store::path::Path;
use object_store::{
    CopyOptions, GetOptions, GetResult, ListResult, MultipartUpload, ObjectMeta, ObjectStore,
    ObjectStoreExt, PutMultipartOptions, PutOptions, PutPayload, PutResult, RenameOptions, Result,
};
use serde::Serialize;

/// Where the native format keeps tensor bytes.
const DATA_PREFIX: &str = "chunks";
/// Where commit records live.
const MANIFESTS: &str = "manifests/";

/// Requests of the kinds a store bills, and the bytes they moved.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct Requests {
    /// Gets with a body (ranged reads included).
    pub get: u64,
    /// Puts, counting each request of a multipart upload.
    pub put: u64,
    /// Listings.
    pub list: u64,
    /// Objects deleted.
    pub delete: u64,
    /// Heads.
    pub head: u64,
    /// Bytes returned by gets.
    pub get_bytes: u64,
    /// Bytes written.
    pub put_bytes: u64,
    /// Objects the listings returned.
    pub listed: u64,
}

impl Requests {
    /// The requests of `c`.
    pub fn of(c: &OpCounts) -> Requests {
        Requests {
            get: c.gets,
            put: c.puts + c.multipart_uploads + c.parts + c.multipart_completes,
            list: c.lists,
            delete: c.deletes,
            head: c.heads,
            get_bytes: c.get_bytes,
            put_bytes: c.written_bytes(),
            listed: 0,
        }
    }

    /// Every request.
    pub fn total(&self) -> u64 {
        self.get + self.put + self.list + self.delete + self.head
    }

    /// Field by field sum.
    pub fn add(&self, o: &Requests) -> Requests {
        Requests {
            get: self.get + o.get,
            put: self.put + o.put,
            list: self.list + o.list,
            delete: self.delete + o.delete,
            head: self.head + o.head,
            get_bytes: self.get_bytes + o.get_bytes,
            put_bytes: self.put_bytes + o.put_bytes,
            listed: self.listed + o.listed,
        }
    }

    /// Field by field maximum.
    pub fn max(&self, o: &Requests) -> Requests {
        Requests {
            get: self.get.max(o.get),
            put: self.put.max(o.put),
            list: self.list.max(o.list),
            delete: self.delete.max(o.delete),
            head: self.head.max(o.head),
            get_bytes: self.get_bytes.max(o.get_bytes),
            put_bytes: self.put_bytes.max(o.put_bytes),
            listed: self.listed.max(o.listed),
        }
    }
}

/// A snapshot of a rank's counters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Split {
    /// Requests on data keys.
    pub data: OpCounts,
    /// Requests on every other key.
    pub meta: OpCounts,
    /// Objects listings returned.
    pub listed: u64,
}

impl Split {
    /// The requests of both kinds of key.
    pub fn all(&self) -> Requests {
        Requests {
            listed: self.listed,
            ..Requests::of(&self.data).add(&Requests::of(&self.meta))
        }
    }

    /// The requests on metadata keys.
    pub fn meta(&self) -> Requests {
        Requests::of(&self.meta)
    }
}

impl std::ops::Sub for Split {
    type Output = Split;
    fn sub(self, o: Split) -> Split {
        Split {
            data: self.data - o.data,
            meta: self.meta - o.meta,
            listed: self.listed - o.listed,
        }
    }
}

/// One rank's counted view of the shared store.
#[derive(Debug)]
pub struct RankStore {
    data: CountingStore,
    meta: CountingStore,
    listed: Arc<AtomicU64>,
    /// The counts just after the last manifest put through this view.
    published: Mutex<Option<Split>>,
}

impl RankStore {
    /// A counted view of `inner`.
    pub fn new(inner: Arc<dyn ObjectStore>) -> RankStore {
        RankStore {
            data: CountingStore::new(inner.clone()),
            meta: CountingStore::new(inner),
            listed: Arc::default(),
            published: Mutex::new(None),
        }
    }

    /// The counts so far.
    pub fn counts(&self) -> Split {
        Split {
            data: self.data.counts(),
            meta: self.meta.counts(),
            listed: self.listed.load(Ordering::Relaxed),
        }
    }

    /// The counts just after the last manifest this view published, if any;
    /// taken, so that the next commit's is told from this one's.
    pub fn take_published(&self) -> Option<Split> {
        self.published.lock_unpoisoned().take()
    }

    fn route(&self, p: &Path) -> &CountingStore {
        if p.as_ref().starts_with(DATA_PREFIX) {
            &self.data
        } else {
            &self.meta
        }
    }

    fn counted(
        &self,
        s: BoxStream<'static, Result<ObjectMeta>>,
    ) -> BoxStream<'static, Result<ObjectMeta>> {
        let n = self.listed.clone();
        s.inspect_ok(move |_| {
            n.fetch_add(1, Ordering::Relaxed);
        })
        .boxed()
    }

    fn route_prefix(&self, p: Option<&Path>) -> &CountingStore {
        match p {
            Some(p) => self.route(p),
            None => &self.meta,
        }
    }
}

impl fmt::Display for RankStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "RankStore({})", self.meta)
    }
}

#[async_trait]
impl ObjectStore for RankStore {
    async fn put_opts(
        &self,
        location: &Path,
        payload: PutPayload,
        opts: PutOptions,
    ) -> Result<PutResult> {
        let r = self.route(location).put_opts(location, payload, opts).await;
        if r.is_ok() && location.as_ref().starts_with(MANIFESTS) {
            *self.published.lock_unpoisoned() = Some(self.counts());
        }
        r
    }

    async fn put_multipart_opts(
        &self,
        location: &Path,
        opts: PutMultipartOptions,
    ) -> Result<Box<dyn MultipartUpload>> {
        self.route(location)
            .put_multipart_opts(location, opts)
            .await
    }

    async fn get_opts(&self, location: &Path, options: GetOptions) -> Result<GetResult> {
        self.route(location).get_opts(location, options).await
    }

    async fn get_ranges(&self, location: &Path, ranges: &[Range<u64>]) -> Result<Vec<Bytes>> {
        self.route(location).get_ranges(location, ranges).await
    }

    fn delete_stream(
        &self,
        locations: BoxStream<'static, Result<Path>>,
    ) -> BoxStream<'static, Result<Path>> {
        let (data, meta) = (self.data.clone(), self.meta.clone());
        locations
            .and_then(move |p| {
                let s = if p.as_ref().starts_with(DATA_PREFIX) {
                    data.clone()
                } else {
                    meta.clone()
                };
                async move { s.delete(&p).await.map(|()| p) }
            })
            .boxed()
    }

    fn list(&self, prefix: Option<&Path>) -> BoxStream<'static, Result<ObjectMeta>> {
        self.counted(self.route_prefix(prefix).list(prefix))
    }

    fn list_with_offset(
        &self,
        prefix: Option<&Path>,
        offset: &Path,
    ) -> BoxStream<'static, Result<ObjectMeta>> {
        self.counted(self.route_prefix(prefix).list_with_offset(prefix, offset))
    }

    async fn list_with_delimiter(&self, prefix: Option<&Path>) -> Result<ListResult> {
        let r = self
            .route_prefix(prefix)
            .list_with_delimiter(prefix)
            .await?;
        let n = r.objects.len() + r.common_prefixes.len();
        self.listed.fetch_add(n as u64, Ordering::Relaxed);
        Ok(r)
    }

    async fn copy_opts(&self, from: &Path, to: &Path, options: CopyOptions) -> Result<()> {
        self.route(to).copy_opts(from, to, options).await
    }

    async fn rename_opts(&self, from: &Path, to: &Path, options: RenameOptions) -> Result<()> {
        self.route(to).rename_opts(from, to, options).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn requests_split_by_key_and_the_publication_is_marked() {
        let inner: Arc<dyn ObjectStore> = Arc::new(object_store::memory::InMemory::new());
        let s = RankStore::new(inner);
        s.put(&Path::from("chunks/ab"), vec![0u8; 10].into())
            .await
            .unwrap();
        s.put(&Path::from("epochs/1.claim"), vec![0u8; 3].into())
            .await
            .unwrap();
        assert!(s.take_published().is_none());
        s.put(&Path::from("manifests/1.manifest"), vec![0u8; 5].into())
            .await
            .unwrap();
        let at = s.take_published().unwrap();
        s.get(&Path::from("chunks/ab")).await.unwrap();
        assert_eq!(s.list(Some(&Path::from("chunks"))).count().await, 1);
        s.delete(&Path::from("manifests/1.manifest")).await.unwrap();
        let c = s.counts();
        assert_eq!((c.data.puts, c.data.put_bytes, c.data.gets), (1, 10, 1));
        assert_eq!((c.meta.puts, c.meta.put_bytes), (2, 8));
        assert_eq!((c.data.lists, c.meta.deletes, c.data.deletes), (1, 1, 0));
        let after = (c - at).all();
        assert_eq!(
            (after.get, after.list, after.delete, after.put),
            (1, 1, 1, 0)
        );
        assert_eq!(c.all().get_bytes, 10);
        assert_eq!(c.meta().get_bytes, 0);
    }
}
