//! Local disk with one durability barrier per save instead of an fsync per object.
//!
//! object_store's `LocalFileSystem` with fsync flushes every object (file and
//! directory) as it is written: for a save of many small objects that is thousands
//! of flushes. [`LocalStore`] writes data objects without flushing and remembers
//! them; the engine calls [`Durability::sync`] once a rank's share is written, which
//! flushes all of them in parallel (and each directory once) before the rank reports
//! its share. A manifest is flushed as it is written, since it is the commit point.
//! The order that makes a checkpoint exist only when it is whole is unchanged: every
//! data object is durable before the manifest is written.

use std::collections::BTreeSet;
use std::fmt;
use std::ops::Range;
use std::path::{Path as FsPath, PathBuf};
use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use bytes::Bytes;
use futures::stream::BoxStream;
use futures::StreamExt;
use object_store::local::LocalFileSystem;
use object_store::path::Path;
use object_store::{
    CopyOptions, GetOptions, GetResult, ListResult, MultipartUpload, ObjectMeta, ObjectStore,
    PutMultipartOptions, PutOptions, PutPayload, PutResult, RenameOptions,
};

use crate::error::{Error, Result};
use crate::paths::MANIFESTS;

/// Something that can make everything written so far durable.
#[async_trait]
pub trait Durability: Send + Sync + fmt::Debug {
    /// Flush every object written since the last call to stable storage.
    async fn sync(&self) -> Result<()>;
}

/// A local directory store that defers flushing to [`Durability::sync`].
#[derive(Debug, Clone)]
pub struct LocalStore {
    inner: Arc<LocalFileSystem>,
    root: PathBuf,
    pending: Arc<Mutex<BTreeSet<String>>>,
}

impl LocalStore {
    /// Open (and create) a directory.
    pub fn new(root: &FsPath) -> Result<Self> {
        std::fs::create_dir_all(root)?;
        let root = std::fs::canonicalize(root)?;
        Ok(LocalStore {
            inner: Arc::new(LocalFileSystem::new_with_prefix(&root)?),
            root,
            pending: Arc::new(Mutex::new(BTreeSet::new())),
        })
    }

    /// Objects written and not yet flushed.
    pub fn pending(&self) -> usize {
        self.pending.lock().unwrap_or_else(|p| p.into_inner()).len()
    }

    fn note(&self, key: &Path) {
        self.pending
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(key.to_string());
    }

    fn is_manifest(key: &Path) -> bool {
        key.parts().next().is_some_and(|p| p.as_ref() == MANIFESTS)
    }

    /// Flush files and then their directories, on blocking threads.
    async fn flush(&self, keys: Vec<String>) -> Result<()> {
        let root = self.root.clone();
        let files: Vec<PathBuf> = keys.iter().map(|k| root.join(k)).collect();
        let dirs: BTreeSet<PathBuf> = files
            .iter()
            .filter_map(|f| f.parent().map(FsPath::to_path_buf))
            .collect();
        let flush_all = |paths: Vec<PathBuf>| async move {
            futures::stream::iter(paths)
                .map(|p| tokio::task::spawn_blocking(move || fsync(&p)))
                .buffer_unordered(16)
                .collect::<Vec<_>>()
                .await
                .into_iter()
                .map(|r| r.map_err(|e| Error::Internal(format!("fsync thread: {e}")))?)
                .collect::<Result<()>>()
        };
        flush_all(files).await?;
        flush_all(dirs.into_iter().collect()).await
    }
}

/// fsync a file or directory; one that is gone (an aborted upload) needs nothing.
fn fsync(path: &FsPath) -> Result<()> {
    match std::fs::File::open(path) {
        Ok(f) => Ok(f.sync_all()?),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(e.into()),
    }
}

#[async_trait]
impl Durability for LocalStore {
    async fn sync(&self) -> Result<()> {
        let keys: Vec<String> =
            std::mem::take(&mut *self.pending.lock().unwrap_or_else(|p| p.into_inner()))
                .into_iter()
                .collect();
        if let Err(e) = self.flush(keys.clone()).await {
            // Not flushed: keep them pending so a retry flushes them again.
            self.pending
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .extend(keys);
            return Err(e);
        }
        Ok(())
    }
}

impl fmt::Display for LocalStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "LocalStore({})", self.root.display())
    }
}

#[async_trait]
impl ObjectStore for LocalStore {
    async fn put_opts(
        &self,
        location: &Path,
        payload: PutPayload,
        opts: PutOptions,
    ) -> object_store::Result<PutResult> {
        let r = self.inner.put_opts(location, payload, opts).await?;
        if Self::is_manifest(location) {
            // The commit point: durable before the put returns.
            self.flush(vec![location.to_string()]).await.map_err(|e| {
                object_store::Error::Generic {
                    store: "LocalStore",
                    source: e.to_string().into(),
                }
            })?;
        } else {
            self.note(location);
        }
        Ok(r)
    }

    async fn put_multipart_opts(
        &self,
        location: &Path,
        opts: PutMultipartOptions,
    ) -> object_store::Result<Box<dyn MultipartUpload>> {
        // Noted now; if the upload is aborted, the flush finds no file and moves on.
        self.note(location);
        self.inner.put_multipart_opts(location, opts).await
    }

    async fn get_opts(
        &self,
        location: &Path,
        options: GetOptions,
    ) -> object_store::Result<GetResult> {
        self.inner.get_opts(location, options).await
    }

    async fn get_ranges(
        &self,
        location: &Path,
        ranges: &[Range<u64>],
    ) -> object_store::Result<Vec<Bytes>> {
        self.inner.get_ranges(location, ranges).await
    }

    fn delete_stream(
        &self,
        locations: BoxStream<'static, object_store::Result<Path>>,
    ) -> BoxStream<'static, object_store::Result<Path>> {
        self.inner.delete_stream(locations)
    }

    fn list(&self, prefix: Option<&Path>) -> BoxStream<'static, object_store::Result<ObjectMeta>> {
        self.inner.list(prefix)
    }

    fn list_with_offset(
        &self,
        prefix: Option<&Path>,
        offset: &Path,
    ) -> BoxStream<'static, object_store::Result<ObjectMeta>> {
        self.inner.list_with_offset(prefix, offset)
    }

    async fn list_with_delimiter(&self, prefix: Option<&Path>) -> object_store::Result<ListResult> {
        self.inner.list_with_delimiter(prefix).await
    }

    async fn copy_opts(
        &self,
        from: &Path,
        to: &Path,
        options: CopyOptions,
    ) -> object_store::Result<()> {
        self.inner.copy_opts(from, to, options).await?;
        self.note(to);
        Ok(())
    }

    async fn rename_opts(
        &self,
        from: &Path,
        to: &Path,
        options: RenameOptions,
    ) -> object_store::Result<()> {
        self.inner.rename_opts(from, to, options).await?;
        self.note(to);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use object_store::ObjectStoreExt;

    #[tokio::test]
    async fn data_waits_for_sync_and_manifests_do_not() {
        let dir = tempfile::tempdir().unwrap();
        let store = LocalStore::new(dir.path()).unwrap();
        store
            .put(&Path::from("chunks/a"), vec![1u8; 10].into())
            .await
            .unwrap();
        store
            .put(&Path::from("data/x/f"), vec![2u8; 10].into())
            .await
            .unwrap();
        assert_eq!(store.pending(), 2);
        store
            .put(&Path::from("manifests/m"), vec![3u8; 10].into())
            .await
            .unwrap();
        assert_eq!(store.pending(), 2, "a manifest is flushed as it is written");
        // An upload that never completed leaves no file; sync still succeeds.
        let mut up = store
            .put_multipart(&Path::from("data/x/aborted"))
            .await
            .unwrap();
        up.abort().await.unwrap();
        store.sync().await.unwrap();
        assert_eq!(store.pending(), 0);
        assert_eq!(
            std::fs::read(dir.path().join("chunks/a")).unwrap(),
            vec![1u8; 10]
        );
        crate::conformance::check_put_get_list_delete(&store)
            .await
            .unwrap();
    }
}
