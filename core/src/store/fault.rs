//! [`FaultStore`]: injects failures by a seeded plan.
//!
//! Every operation draws a number from a generator seeded by
//! [`FaultPlan::seed`] and the operation's sequence number, and the plan's
//! probabilities decide what happens to it:
//!
//! | fault | what the caller sees | what is stored |
//! | --- | --- | --- |
//! | error | an error at once | nothing |
//! | timeout | an error after [`FaultPlan::timeout`] | nothing |
//! | partial write | an error | the first half of the payload (a torn object) |
//! | lost ack | an error | the whole payload (the write happened, the reply was lost) |
//! | latency | success, up to [`FaultPlan::latency`] later | as asked |
//!
//! So a run with the same seed and the same order of operations meets the same
//! faults. A partial write is harsher than any real object store (which publishes
//! whole objects or nothing): it checks that a torn object can never be taken for
//! a committed checkpoint.

use std::fmt;
use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use futures::stream::BoxStream;
use futures::{FutureExt, StreamExt};
use object_store::path::Path;
use object_store::{
    CopyOptions, GetOptions, GetResult, ListResult, MultipartUpload, ObjectMeta, ObjectStore,
    PutMultipartOptions, PutOptions, PutPayload, PutResult, RenameOptions, Result, UploadPart,
};

use super::generic;

const STORE: &str = "FaultStore";

/// What to inject, and how often. Probabilities are per operation, in `0.0..=1.0`.
#[derive(Debug, Clone, PartialEq)]
pub struct FaultPlan {
    /// Seed of the generator.
    pub seed: u64,
    /// A put (or a part, or a multipart completion) fails.
    pub put_error: f64,
    /// A put hangs for [`FaultPlan::timeout`], then fails.
    pub put_timeout: f64,
    /// A put stores the first half of its payload, then fails (single-request puts only).
    pub put_partial: f64,
    /// A put stores everything, then fails (single-request puts only).
    pub put_lost_ack: f64,
    /// A get or head fails.
    pub get_error: f64,
    /// A listing fails.
    pub list_error: f64,
    /// A delete fails.
    pub delete_error: f64,
    /// Extra latency of every operation: uniform in `0..=latency`.
    pub latency: Duration,
    /// How long a timed-out operation hangs.
    pub timeout: Duration,
    /// Only keys starting with this are faulted (`None`: all keys).
    pub only_prefix: Option<String>,
    /// Stop injecting after this many faults (`None`: never stop).
    pub max_faults: Option<u64>,
}

impl FaultPlan {
    /// No faults at all (a base to change fields of).
    pub fn none(seed: u64) -> Self {
        FaultPlan {
            seed,
            put_error: 0.0,
            put_timeout: 0.0,
            put_partial: 0.0,
            put_lost_ack: 0.0,
            get_error: 0.0,
            list_error: 0.0,
            delete_error: 0.0,
            latency: Duration::ZERO,
            timeout: Duration::from_millis(200),
            only_prefix: None,
            max_faults: None,
        }
    }

    /// Puts fail with probability `p`, spread evenly over error, timeout, partial
    /// write and lost ack.
    pub fn flaky_puts(seed: u64, p: f64) -> Self {
        FaultPlan {
            put_error: p / 4.0,
            put_timeout: p / 4.0,
            put_partial: p / 4.0,
            put_lost_ack: p / 4.0,
            ..FaultPlan::none(seed)
        }
    }
}

/// How many faults of each kind were injected.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct FaultCounts {
    /// Operations seen.
    pub ops: u64,
    /// Plain errors.
    pub errors: u64,
    /// Timeouts.
    pub timeouts: u64,
    /// Partial writes.
    pub partial: u64,
    /// Lost acknowledgements.
    pub lost_acks: u64,
}

impl FaultCounts {
    /// Every fault injected.
    pub fn total(&self) -> u64 {
        self.errors + self.timeouts + self.partial + self.lost_acks
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fault {
    None,
    Error,
    Timeout,
    Partial,
    LostAck,
}

#[derive(Debug)]
struct Shared {
    plan: FaultPlan,
    enabled: AtomicBool,
    seq: AtomicU64,
    counts: [AtomicU64; 5],
}

fn splitmix64(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

impl Shared {
    /// Draw the fault for one operation. `kinds` are (probability, fault) pairs.
    fn draw(&self, key: Option<&Path>, kinds: &[(f64, Fault)]) -> (Fault, Duration) {
        let n = self.seq.fetch_add(1, Ordering::Relaxed);
        self.counts[0].fetch_add(1, Ordering::Relaxed);
        let r1 = splitmix64(self.plan.seed ^ splitmix64(n));
        let r2 = splitmix64(r1);
        let unit = |r: u64| (r >> 11) as f64 / (1u64 << 53) as f64;
        let latency = self.plan.latency.mul_f64(unit(r2));
        if !self.enabled.load(Ordering::Relaxed) {
            return (Fault::None, Duration::ZERO);
        }
        if let (Some(p), Some(k)) = (&self.plan.only_prefix, key) {
            if !k.as_ref().starts_with(p.as_str()) {
                return (Fault::None, latency);
            }
        }
        let injected: u64 = self.counts[1..]
            .iter()
            .map(|c| c.load(Ordering::Relaxed))
            .sum();
        if self.plan.max_faults.is_some_and(|m| injected >= m) {
            return (Fault::None, latency);
        }
        let u = unit(r1);
        let mut acc = 0.0;
        for &(p, f) in kinds {
            acc += p;
            if u < acc {
                let i = match f {
                    Fault::Error => 1,
                    Fault::Timeout => 2,
                    Fault::Partial => 3,
                    _ => 4,
                };
                self.counts[i].fetch_add(1, Ordering::Relaxed);
                return (f, latency);
            }
        }
        (Fault::None, latency)
    }

    fn put_kinds(&self, single: bool) -> Vec<(f64, Fault)> {
        let p = &self.plan;
        let mut v = vec![(p.put_error, Fault::Error), (p.put_timeout, Fault::Timeout)];
        if single {
            v.extend([
                (p.put_partial, Fault::Partial),
                (p.put_lost_ack, Fault::LostAck),
            ]);
        }
        v
    }

    async fn before(&self, key: Option<&Path>, kinds: &[(f64, Fault)], op: &str) -> Result<Fault> {
        let (fault, latency) = self.draw(key, kinds);
        if !latency.is_zero() {
            tokio::time::sleep(latency).await;
        }
        let what = key
            .map(|k| format!("{op} `{k}`"))
            .unwrap_or_else(|| op.to_owned());
        match fault {
            Fault::Error => Err(generic(STORE, format!("injected error on {what}"))),
            Fault::Timeout => {
                tokio::time::sleep(self.plan.timeout).await;
                Err(generic(STORE, format!("injected timeout on {what}")))
            }
            other => Ok(other),
        }
    }
}

/// Wraps a store and injects the faults of a [`FaultPlan`]. Clones share the plan's state.
#[derive(Debug, Clone)]
pub struct FaultStore {
    inner: Arc<dyn ObjectStore>,
    shared: Arc<Shared>,
}

impl FaultStore {
    /// Inject `plan`'s faults into operations on `inner`.
    pub fn new(inner: Arc<dyn ObjectStore>, plan: FaultPlan) -> Self {
        let shared = Shared {
            plan,
            enabled: AtomicBool::new(true),
            seq: AtomicU64::new(0),
            counts: Default::default(),
        };
        FaultStore {
            inner,
            shared: Arc::new(shared),
        }
    }

    /// Turn injection on or off (latency stays off while disabled).
    pub fn set_enabled(&self, on: bool) {
        self.shared.enabled.store(on, Ordering::Relaxed);
    }

    /// What was injected so far.
    pub fn injected(&self) -> FaultCounts {
        let c = |i: usize| self.shared.counts[i].load(Ordering::Relaxed);
        FaultCounts {
            ops: c(0),
            errors: c(1),
            timeouts: c(2),
            partial: c(3),
            lost_acks: c(4),
        }
    }

    /// The store under the faults.
    pub fn inner(&self) -> &Arc<dyn ObjectStore> {
        &self.inner
    }
}

impl fmt::Display for FaultStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "FaultStore(seed {}, {})",
            self.shared.plan.seed, self.inner
        )
    }
}

#[async_trait]
impl ObjectStore for FaultStore {
    async fn put_opts(
        &self,
        location: &Path,
        payload: PutPayload,
        opts: PutOptions,
    ) -> Result<PutResult> {
        let kinds = self.shared.put_kinds(true);
        match self.shared.before(Some(location), &kinds, "put").await? {
            Fault::Partial => {
                let bytes: Bytes = payload.into_iter().flatten().collect::<Vec<u8>>().into();
                let torn = bytes.slice(..bytes.len() / 2);
                self.inner.put_opts(location, torn.into(), opts).await?;
                Err(generic(
                    STORE,
                    format!("injected partial write of `{location}`"),
                ))
            }
            Fault::LostAck => {
                self.inner.put_opts(location, payload, opts).await?;
                Err(generic(
                    STORE,
                    format!("injected lost acknowledgement of put `{location}`"),
                ))
            }
            _ => self.inner.put_opts(location, payload, opts).await,
        }
    }

    async fn put_multipart_opts(
        &self,
        location: &Path,
        opts: PutMultipartOptions,
    ) -> Result<Box<dyn MultipartUpload>> {
        let kinds = self.shared.put_kinds(false);
        self.shared
            .before(Some(location), &kinds, "start upload")
            .await?;
        let upload = self.inner.put_multipart_opts(location, opts).await?;
        Ok(Box::new(FaultUpload {
            upload,
            shared: self.shared.clone(),
            location: location.clone(),
        }))
    }

    async fn get_opts(&self, location: &Path, options: GetOptions) -> Result<GetResult> {
        let kinds = [(self.shared.plan.get_error, Fault::Error)];
        self.shared.before(Some(location), &kinds, "get").await?;
        self.inner.get_opts(location, options).await
    }

    async fn get_ranges(&self, location: &Path, ranges: &[Range<u64>]) -> Result<Vec<Bytes>> {
        let kinds = [(self.shared.plan.get_error, Fault::Error)];
        self.shared
            .before(Some(location), &kinds, "get ranges")
            .await?;
        self.inner.get_ranges(location, ranges).await
    }

    fn delete_stream(
        &self,
        locations: BoxStream<'static, Result<Path>>,
    ) -> BoxStream<'static, Result<Path>> {
        let shared = self.shared.clone();
        let inner = self.inner.clone();
        locations
            .then(move |loc| {
                let (shared, inner) = (shared.clone(), inner.clone());
                async move {
                    let loc = loc?;
                    let kinds = [(shared.plan.delete_error, Fault::Error)];
                    shared.before(Some(&loc), &kinds, "delete").await?;
                    let mut s =
                        inner.delete_stream(futures::stream::once(async move { Ok(loc) }).boxed());
                    s.next()
                        .await
                        .unwrap_or_else(|| Err(generic(STORE, "delete yielded nothing")))
                }
            })
            .boxed()
    }

    fn list(&self, prefix: Option<&Path>) -> BoxStream<'static, Result<ObjectMeta>> {
        let shared = self.shared.clone();
        let inner = self.inner.clone();
        let prefix = prefix.cloned();
        async move {
            let kinds = [(shared.plan.list_error, Fault::Error)];
            match shared.before(prefix.as_ref(), &kinds, "list").await {
                Ok(_) => inner.list(prefix.as_ref()),
                Err(e) => futures::stream::once(async move { Err(e) }).boxed(),
            }
        }
        .flatten_stream()
        .boxed()
    }

    async fn list_with_delimiter(&self, prefix: Option<&Path>) -> Result<ListResult> {
        let kinds = [(self.shared.plan.list_error, Fault::Error)];
        self.shared.before(prefix, &kinds, "list").await?;
        self.inner.list_with_delimiter(prefix).await
    }

    async fn copy_opts(&self, from: &Path, to: &Path, options: CopyOptions) -> Result<()> {
        let kinds = self.shared.put_kinds(false);
        self.shared.before(Some(to), &kinds, "copy to").await?;
        self.inner.copy_opts(from, to, options).await
    }

    async fn rename_opts(&self, from: &Path, to: &Path, options: RenameOptions) -> Result<()> {
        let kinds = self.shared.put_kinds(false);
        self.shared.before(Some(to), &kinds, "rename to").await?;
        self.inner.rename_opts(from, to, options).await
    }
}

#[derive(Debug)]
struct FaultUpload {
    upload: Box<dyn MultipartUpload>,
    shared: Arc<Shared>,
    location: Path,
}

#[async_trait]
impl MultipartUpload for FaultUpload {
    fn put_part(&mut self, data: PutPayload) -> UploadPart {
        let shared = self.shared.clone();
        let location = self.location.clone();
        let fut = self.upload.put_part(data);
        Box::pin(async move {
            let kinds = shared.put_kinds(false);
            shared
                .before(Some(&location), &kinds, "put part of")
                .await?;
            fut.await
        })
    }

    async fn complete(&mut self) -> Result<PutResult> {
        let kinds = self.shared.put_kinds(false);
        self.shared
            .before(Some(&self.location), &kinds, "complete upload of")
            .await?;
        self.upload.complete().await
    }

    async fn abort(&mut self) -> Result<()> {
        self.upload.abort().await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use object_store::ObjectStoreExt;

    async fn outcomes(seed: u64) -> Vec<bool> {
        let store = FaultStore::new(
            Arc::new(object_store::memory::InMemory::new()),
            FaultPlan {
                timeout: Duration::from_millis(1),
                ..FaultPlan::flaky_puts(seed, 0.5)
            },
        );
        let mut v = Vec::new();
        for i in 0..40 {
            v.push(
                store
                    .put(
                        &Path::from(format!("k{i}")),
                        Bytes::from_static(b"abcd").into(),
                    )
                    .await
                    .is_ok(),
            );
        }
        v
    }

    #[tokio::test]
    async fn same_seed_same_faults() {
        let a = outcomes(7).await;
        assert_eq!(a, outcomes(7).await);
        assert_ne!(a, outcomes(8).await);
        let failed = a.iter().filter(|ok| !**ok).count();
        assert!(
            (5..35).contains(&failed),
            "{failed} of 40 puts failed at p = 0.5"
        );
    }

    #[tokio::test]
    async fn partial_write_leaves_a_torn_object() {
        let mem: Arc<dyn ObjectStore> = Arc::new(object_store::memory::InMemory::new());
        let plan = FaultPlan {
            put_partial: 1.0,
            ..FaultPlan::none(1)
        };
        let store = FaultStore::new(mem.clone(), plan);
        let key = Path::from("x");
        assert!(store
            .put(&key, Bytes::from_static(b"12345678").into())
            .await
            .is_err());
        let got = mem.get(&key).await.unwrap().bytes().await.unwrap();
        assert_eq!(&got[..], b"1234");
        assert_eq!(store.injected().partial, 1);
        store.set_enabled(false);
        store
            .put(&key, Bytes::from_static(b"12345678").into())
            .await
            .unwrap();
    }
}
