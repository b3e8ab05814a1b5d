//! [`RetryStore`]: retries transient failures with exponential backoff, and bounds
//! each attempt by a timeout.
//!
//! Retrying is safe for ckpt's keys: chunks are content-addressed and every other
//! key is unique to its save attempt, so a repeated put writes the same bytes. A
//! create-only put whose first attempt did reach the store but whose reply was lost
//! comes back as `AlreadyExists` on retry; the wrapper then reads the object back
//! and reports success only when it holds exactly the bytes it was asked to write.
//!
//! Not retried: `NotFound`, `AlreadyExists`, `Precondition`, `NotModified`,
//! permission and configuration errors, and multipart parts (the S3 client retries
//! those requests itself; a payload handed to a part cannot be replayed here).

use std::fmt;
use std::future::Future;
use std::ops::Range;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use futures::stream::BoxStream;
use futures::{StreamExt, TryStreamExt};
use object_store::path::Path;
use object_store::{
    CopyOptions, GetOptions, GetResult, ListResult, MultipartUpload, ObjectMeta, ObjectStore,
    ObjectStoreExt, PutMode, PutMultipartOptions, PutOptions, PutPayload, PutResult, RenameOptions,
    Result,
};

use super::generic;

const STORE: &str = "RetryStore";

/// How [`RetryStore`] retries.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RetryOptions {
    /// Retries after the first attempt.
    pub max_retries: u32,
    /// Delay before the first retry; doubled for each further one.
    pub init_backoff: Duration,
    /// Longest delay between attempts.
    pub max_backoff: Duration,
    /// An attempt that takes longer fails (and is retried); `None`: no limit.
    pub attempt_timeout: Option<Duration>,
}

impl Default for RetryOptions {
    fn default() -> Self {
        RetryOptions {
            max_retries: 5,
            init_backoff: Duration::from_millis(20),
            max_backoff: Duration::from_secs(2),
            attempt_timeout: Some(Duration::from_secs(120)),
        }
    }
}

/// True for errors that another attempt may not meet.
pub fn is_transient(e: &object_store::Error) -> bool {
    use object_store::Error as E;
    !matches!(
        e,
        E::NotFound { .. }
            | E::AlreadyExists { .. }
            | E::Precondition { .. }
            | E::NotModified { .. }
            | E::NotSupported { .. }
            | E::NotImplemented { .. }
            | E::PermissionDenied { .. }
            | E::Unauthenticated { .. }
            | E::InvalidPath { .. }
            | E::UnknownConfigurationKey { .. }
    )
}

/// Wraps a store and retries its transient failures.
#[derive(Debug, Clone)]
pub struct RetryStore {
    inner: Arc<dyn ObjectStore>,
    opts: RetryOptions,
}

impl RetryStore {
    /// Retry operations on `inner` as `opts` say.
    pub fn new(inner: Arc<dyn ObjectStore>, opts: RetryOptions) -> Self {
        RetryStore { inner, opts }
    }

    fn backoff(&self, attempt: u32) -> Duration {
        let factor = 1u32.checked_shl(attempt.min(20)).unwrap_or(u32::MAX);
        self.opts
            .init_backoff
            .saturating_mul(factor)
            .min(self.opts.max_backoff)
    }

    /// Run `op` until it succeeds, fails for good, or the retries are spent.
    /// Returns the result and the number of attempts made.
    async fn retry<T, F, Fut>(&self, what: &str, mut op: F) -> (Result<T>, u32)
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<T>>,
    {
        let mut attempt = 0;
        loop {
            let r = match self.opts.attempt_timeout {
                Some(t) => match tokio::time::timeout(t, op()).await {
                    Ok(r) => r,
                    Err(_) => Err(generic(STORE, format!("{what} timed out after {t:?}"))),
                },
                None => op().await,
            };
            match r {
                Err(e) if is_transient(&e) && attempt < self.opts.max_retries => {
                    tracing::debug!("{what} failed (attempt {}), retrying: {e}", attempt + 1);
                    tokio::time::sleep(self.backoff(attempt)).await;
                    attempt += 1;
                }
                r => return (r, attempt + 1),
            }
        }
    }
}

impl fmt::Display for RetryStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "RetryStore({}, {})", self.opts.max_retries, self.inner)
    }
}

#[async_trait]
impl ObjectStore for RetryStore {
    async fn put_opts(
        &self,
        location: &Path,
        payload: PutPayload,
        opts: PutOptions,
    ) -> Result<PutResult> {
        let create = matches!(opts.mode, PutMode::Create);
        let what = format!("put `{location}`");
        let (r, attempts) = self
            .retry(&what, || {
                self.inner.put_opts(location, payload.clone(), opts.clone())
            })
            .await;
        match r {
            // Our own earlier attempt may have landed: accept it only if it is byte-identical.
            Err(object_store::Error::AlreadyExists { .. }) if create && attempts > 1 => {
                let (stored, _) = self
                    .retry(&what, || async {
                        self.inner.get(location).await?.bytes().await
                    })
                    .await;
                let stored = stored?;
                let want: Vec<u8> = payload.iter().flat_map(|b| b.iter().copied()).collect();
                if stored[..] == want[..] {
                    let meta = self.inner.head(location).await?;
                    Ok(PutResult {
                        e_tag: meta.e_tag,
                        version: meta.version,
                        extensions: Default::default(),
                    })
                } else {
                    Err(object_store::Error::AlreadyExists {
                        path: location.to_string(),
                        source: "another writer's object is there (found on retry)".into(),
                    })
                }
            }
            r => r,
        }
    }

    async fn put_multipart_opts(
        &self,
        location: &Path,
        opts: PutMultipartOptions,
    ) -> Result<Box<dyn MultipartUpload>> {
        let what = format!("start upload `{location}`");
        self.retry(&what, || {
            self.inner.put_multipart_opts(location, opts.clone())
        })
        .await
        .0
    }

    async fn get_opts(&self, location: &Path, options: GetOptions) -> Result<GetResult> {
        let what = format!("get `{location}`");
        self.retry(&what, || self.inner.get_opts(location, options.clone()))
            .await
            .0
    }

    async fn get_ranges(&self, location: &Path, ranges: &[Range<u64>]) -> Result<Vec<Bytes>> {
        let what = format!("get ranges of `{location}`");
        self.retry(&what, || self.inner.get_ranges(location, ranges))
            .await
            .0
    }

    fn delete_stream(
        &self,
        locations: BoxStream<'static, Result<Path>>,
    ) -> BoxStream<'static, Result<Path>> {
        let this = self.clone();
        locations
            .then(move |loc| {
                let this = this.clone();
                async move {
                    let loc = loc?;
                    let what = format!("delete `{loc}`");
                    let (r, _) = this.retry(&what, || this.inner.delete(&loc)).await;
                    r.map(|()| loc)
                }
            })
            .boxed()
    }

    fn list(&self, prefix: Option<&Path>) -> BoxStream<'static, Result<ObjectMeta>> {
        // A listing is retried whole: it is collected, then streamed.
        let this = self.clone();
        let prefix = prefix.cloned();
        futures::stream::once(async move {
            let what = format!("list {:?}", prefix.as_ref().map(|p| p.as_ref()));
            let (r, _) = this
                .retry(&what, || {
                    this.inner.list(prefix.as_ref()).try_collect::<Vec<_>>()
                })
                .await;
            r
        })
        .map_ok(|v| futures::stream::iter(v.into_iter().map(Ok)))
        .try_flatten()
        .boxed()
    }

    async fn list_with_delimiter(&self, prefix: Option<&Path>) -> Result<ListResult> {
        self.retry("list", || self.inner.list_with_delimiter(prefix))
            .await
            .0
    }

    async fn copy_opts(&self, from: &Path, to: &Path, options: CopyOptions) -> Result<()> {
        let what = format!("copy to `{to}`");
        self.retry(&what, || self.inner.copy_opts(from, to, options.clone()))
            .await
            .0
    }

    async fn rename_opts(&self, from: &Path, to: &Path, options: RenameOptions) -> Result<()> {
        self.inner.rename_opts(from, to, options).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::fault::{FaultPlan, FaultStore};

    #[tokio::test]
    async fn lost_ack_on_create_is_recognised_as_ours() {
        let mem: Arc<dyn ObjectStore> = Arc::new(object_store::memory::InMemory::new());
        let plan = FaultPlan {
            put_lost_ack: 1.0,
            max_faults: Some(1),
            ..FaultPlan::none(3)
        };
        let store = RetryStore::new(
            Arc::new(FaultStore::new(mem.clone(), plan)),
            RetryOptions::default(),
        );
        let key = Path::from("manifests/m");
        let create = PutOptions {
            mode: PutMode::Create,
            ..Default::default()
        };
        store
            .put_opts(&key, Bytes::from_static(b"mine").into(), create.clone())
            .await
            .unwrap();
        // A different payload under the same key is still refused.
        let err = store
            .put_opts(&key, Bytes::from_static(b"other").into(), create)
            .await
            .unwrap_err();
        assert!(
            matches!(err, object_store::Error::AlreadyExists { .. }),
            "{err}"
        );
        assert_eq!(
            &mem.get(&key).await.unwrap().bytes().await.unwrap()[..],
            b"mine"
        );
    }

    #[tokio::test]
    async fn gives_up_after_max_retries() {
        let mem: Arc<dyn ObjectStore> = Arc::new(object_store::memory::InMemory::new());
        let plan = FaultPlan {
            put_timeout: 1.0,
            timeout: Duration::from_millis(5),
            ..FaultPlan::none(4)
        };
        let faulty = FaultStore::new(mem, plan);
        let opts = RetryOptions {
            max_retries: 3,
            ..Default::default()
        };
        let store = RetryStore::new(Arc::new(faulty.clone()), opts);
        assert!(store
            .put(&Path::from("k"), Bytes::from_static(b"x").into())
            .await
            .is_err());
        assert_eq!(faulty.injected().timeouts, 4);
    }
}
