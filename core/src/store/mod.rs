//! Opening a store from a URL, and the wrappers that add behaviour to any store.
//!
//! | URL | backend |
//! | --- | --- |
//! | `file:///abs/dir` or a plain path | local disk, files and directories fsynced, large writes around the page cache ([`direct::LocalDir`]) |
//! | `memory://name` | in-process memory; the same name in one process is the same store |
//! | `s3://bucket/prefix` | S3 (feature `s3`), configured from the usual `AWS_*` variables ([`s3`]) |
//! | `tiered+<fast URL>?durable=<durable URL>` | a fast tier flushed to a durable one ([`TieredCheckpointStore`], an engine component) |
//!
//! What each kind of store is good at (atomic creates, coalesced ranged reads,
//! direct I/O) is said by its [`Capabilities`] ([`Capabilities::of_url`]), not
//! decided from URL prefixes where the engine uses it.
//!
//! Every store is rooted at the URL's path, so keys inside it are always
//! `chunks/...`, `data/...`, `manifests/...`.
//!
//! Behaviour is added by wrapping, in the `object_store` style, never by flags:
//! [`retry::RetryStore`] (retries with backoff and per-attempt timeouts),
//! `fault::FaultStore` (failures by a seeded plan, for tests and fault campaigns;
//! feature `testing`),
//! [`counting::CountingStore`] (operations and bytes), and `object_store`'s own
//! `LimitStore` (bounded concurrency) and `PrefixStore`.

pub mod caps;
pub mod counting;
pub mod direct;
#[cfg(any(test, feature = "testing"))]
pub mod fault;
pub mod retry;
pub mod s3;

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use object_store::local::LocalFileSystem;
use object_store::memory::InMemory;
use object_store::ObjectStore;

use crate::error::{Error, Result};
use crate::sync::MutexExt;
use crate::tiered::{TieredCheckpointStore, TieredUrl, SCHEME_PREFIX};

pub use caps::Capabilities;
pub use counting::{CountingStore, OpCounts};
pub use direct::{LocalDir, LocalDirOptions};
#[cfg(any(test, feature = "testing"))]
pub use fault::{FaultCounts, FaultPlan, FaultStore};
pub use retry::{RetryOptions, RetryStore};
pub use s3::S3Options;

/// How [`open_url_with`] opens the stores a URL names.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct StoreOptions {
    /// Local directories (`file://` and plain paths, both tiers of a
    /// `tiered+` URL alike).
    pub local_dir: LocalDirOptions,
}

/// Open the store a URL names, with the default [`StoreOptions`].
///
/// Errors: [`Error::InvalidInput`] for a malformed URL or incomplete S3
/// configuration, [`Error::Unsupported`] for an unknown scheme or `s3://` in a
/// build without the `s3` feature.
pub fn open_url(url: &str) -> Result<Arc<dyn ObjectStore>> {
    open_url_with(url, &StoreOptions::default())
}

/// Open the store a URL names, with these options; errors as [`open_url`]'s.
pub fn open_url_with(url: &str, opts: &StoreOptions) -> Result<Arc<dyn ObjectStore>> {
    if url.starts_with(SCHEME_PREFIX) {
        return Ok(Arc::new(open_tiered_with(url, opts)?));
    }
    match url.split_once("://") {
        None => open_dir_with(std::path::Path::new(url), opts.local_dir.clone()),
        Some(("file", _)) => {
            let parsed = url::Url::parse(url)
                .map_err(|e| Error::InvalidInput(format!("bad URL `{url}`: {e}")))?;
            let path = parsed
                .to_file_path()
                .map_err(|_| Error::InvalidInput(format!("`{url}` is not an absolute file URL")))?;
            open_dir_with(&path, opts.local_dir.clone())
        }
        Some(("memory", name)) => Ok(memory_store(name)),
        Some(("s3", _)) => s3::open_url(url),
        Some((scheme, _)) => Err(Error::Unsupported(format!(
            "storage scheme `{scheme}://` is not supported (file://, memory://, s3://, tiered+...)"
        ))),
    }
}

/// Open `tiered+<fast URL>?durable=<durable URL>[&durable_keep_last=N]`, keeping
/// the [`TieredCheckpointStore`] (to call its `flush` before exit).
pub fn open_tiered(url: &str) -> Result<TieredCheckpointStore> {
    open_tiered_with(url, &StoreOptions::default())
}

/// [`open_tiered`] with these options for both tiers.
pub fn open_tiered_with(url: &str, opts: &StoreOptions) -> Result<TieredCheckpointStore> {
    let u = TieredUrl::parse(url)?;
    Ok(TieredCheckpointStore::new(
        open_url_with(&u.fast, opts)?,
        open_url_with(&u.durable, opts)?,
        u.options,
    ))
}

/// Local directory store with fsync of files and directories, whose large
/// writes bypass the page cache ([`LocalDir`] with the default options).
pub fn open_dir(path: &std::path::Path) -> Result<Arc<dyn ObjectStore>> {
    open_dir_with(path, LocalDirOptions::default())
}

/// [`open_dir`] with these options, over which [`direct::DIRECT_IO_ENV`]
/// (`CKPT_DIRECT_IO`), where set, takes precedence.
pub fn open_dir_with(
    path: &std::path::Path,
    opts: LocalDirOptions,
) -> Result<Arc<dyn ObjectStore>> {
    std::fs::create_dir_all(path)?;
    let fs = LocalFileSystem::new_with_prefix(path)?.with_fsync(true);
    Ok(Arc::new(LocalDir::new(fs, opts.with_env_override())))
}

/// The process-wide in-memory store of a name.
pub fn memory_store(name: &str) -> Arc<dyn ObjectStore> {
    static STORES: OnceLock<Mutex<HashMap<String, Arc<InMemory>>>> = OnceLock::new();
    let mut map = STORES.get_or_init(Default::default).lock_unpoisoned();
    map.entry(name.to_owned())
        .or_insert_with(|| Arc::new(InMemory::new()))
        .clone()
}

/// The error a wrapper reports for a failure it made up or detected itself.
pub(crate) fn generic(store: &'static str, msg: impl Into<String>) -> object_store::Error {
    object_store::Error::Generic {
        store,
        source: msg.into().into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn schemes() {
        assert!(open_url("memory://a").is_ok());
        assert!(Arc::ptr_eq(
            &(memory_store("same") as Arc<dyn ObjectStore>),
            &(memory_store("same") as Arc<dyn ObjectStore>)
        ));
        assert!(matches!(open_url("gopher://x"), Err(Error::Unsupported(_))));
        assert!(matches!(
            open_url("file://relative/path"),
            Err(Error::InvalidInput(_))
        ));
        let dir = tempfile::tempdir().unwrap();
        let url = format!("file://{}/sub", dir.path().display());
        assert!(open_url(&url).is_ok());
        assert!(dir.path().join("sub").is_dir());
    }
}
