//! [`RollCall`]: a [`Coordinator`] wrapper that names the ranks a collective
//! waited for in vain.
//!
//! A collective that times out knows only that it did not complete; MPI and
//! gloo cannot say which rank never came. The ranks of one checkpointer share
//! one thing besides the communicator: the checkpoint store. So a rank that has
//! waited in a collective for a while puts a mark there,
//! `attendance/<job nonce>/<rank>` ([`crate::layout::paths`]), and deletes it
//! when the wait ends. When a collective times out (or fails: a peer's
//! connection closed), the rank puts its mark, lets the others put theirs, and
//! lists the marks: every rank with none was not waiting in any collective
//! (it is late, dead, hung, or busy elsewhere) and is named in
//! [`Error::Stragglers`]. Ranks that are waiting in a *different* collective
//! (rank 0 in a gather, the others already in the broadcast after it) are
//! marked too, so they are not taken for stragglers.
//!
//! Costs: nothing on a collective that completes within `mark_after`; one
//! put and one delete on one that waits longer; one put and one listing (of
//! at most the job's ranks) on one that fails. The inner collective gets the
//! timeout less a reserve (an eighth, at most 4 s) in which the roll call
//! runs, so the named error comes within `collective_timeout`. After a
//! failure the coordinator is out of step; later failures pass unchanged.

use std::collections::BTreeSet;
use std::fmt;
use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use futures::TryStreamExt;
use object_store::{ObjectStore, ObjectStoreExt, PutPayload};

use super::Coordinator;
use crate::error::{Error, Result};
use crate::layout::paths;

/// A coordinator whose timeouts name the ranks that were not taking part.
pub struct RollCall {
    inner: Arc<dyn Coordinator>,
    store: Arc<dyn ObjectStore>,
    nonce: String,
    /// Collectives called through this wrapper, for messages.
    round: AtomicU64,
    /// A roll call was made: the ranks are out of step from here on.
    failed: AtomicBool,
}

impl fmt::Debug for RollCall {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RollCall")
            .field("inner", &self.inner)
            .field("nonce", &self.nonce)
            .finish()
    }
}

/// How long a collective waits before its rank marks itself present.
fn mark_after(timeout: Duration) -> Duration {
    (timeout / 4).min(Duration::from_secs(5))
}

/// The part of the timeout kept for the roll call.
fn reserve(timeout: Duration) -> Duration {
    (timeout / 8).min(Duration::from_secs(4))
}

impl RollCall {
    /// Wrap `inner` for the job whose ranks agreed on `nonce` (every rank
    /// the same; a new one for every opening), marking on `store`.
    pub fn new(inner: Arc<dyn Coordinator>, store: Arc<dyn ObjectStore>, nonce: &str) -> Self {
        RollCall {
            inner,
            store,
            nonce: nonce.to_owned(),
            round: AtomicU64::new(0),
            failed: AtomicBool::new(false),
        }
    }

    async fn mark(&self) -> Result<()> {
        let key = paths::attendance_key(&self.nonce, self.inner.rank());
        self.store.put(&key, PutPayload::new()).await?;
        Ok(())
    }

    async fn unmark(&self) {
        let key = paths::attendance_key(&self.nonce, self.inner.rank());
        // A mark left behind only costs a key: GC's full sweep removes it.
        let _ = self.store.delete(&key).await;
    }

    /// The ranks with a mark.
    async fn present(&self) -> Result<BTreeSet<usize>> {
        let prefix = paths::attendance_prefix(&self.nonce);
        let metas: Vec<_> = self.store.list(Some(&prefix)).try_collect().await?;
        Ok(metas
            .iter()
            .filter_map(|m| paths::parse_attendance_key(&m.location))
            .collect())
    }

    /// Run `call` (given the timeout it may take), marking this rank once it
    /// has waited `mark_after`; on a failure, the roll call.
    async fn attend<T, F>(
        &self,
        what: &str,
        timeout: Duration,
        call: impl FnOnce(Duration) -> F,
    ) -> Result<T>
    where
        F: Future<Output = Result<T>>,
    {
        let n = self.round.fetch_add(1, Ordering::Relaxed);
        if self.inner.world_size() == 1 || self.failed.load(Ordering::Relaxed) {
            return call(timeout).await;
        }
        let reserve = reserve(timeout);
        let call = call(timeout - reserve);
        tokio::pin!(call);
        let (result, marked) = tokio::select! {
            r = &mut call => (r, false),
            _ = tokio::time::sleep(mark_after(timeout)) => {
                let (m, r) = tokio::join!(self.mark(), &mut call);
                (r, m.is_ok())
            }
        };
        match result {
            Err(Error::Timeout(message)) => {
                self.failed.store(true, Ordering::Relaxed);
                let what = format!("{what} (collective {n} of this checkpointer)");
                match tokio::time::timeout(reserve, self.roll_call(marked, reserve / 2)).await {
                    Ok(Ok(present)) => {
                        let world = self.inner.world_size();
                        let ranks: Vec<usize> =
                            (0..world).filter(|r| !present.contains(r)).collect();
                        if ranks.is_empty() {
                            // Everyone was waiting: the communicator itself failed.
                            return Err(Error::Timeout(message));
                        }
                        Err(Error::Stragglers {
                            what,
                            ranks,
                            world,
                            timeout_ms: timeout.as_millis().try_into().unwrap_or(u64::MAX),
                        })
                    }
                    // The store could not say: the collective's own error.
                    _ => Err(Error::Timeout(message)),
                }
            }
            r => {
                if marked {
                    self.unmark().await;
                }
                r
            }
        }
    }

    /// Mark this rank (unless it is), give the others `settle` to mark
    /// themselves, and list who is present.
    async fn roll_call(&self, marked: bool, settle: Duration) -> Result<BTreeSet<usize>> {
        if !marked {
            self.mark().await?;
        }
        tokio::time::sleep(settle).await;
        self.present().await
    }
}

#[async_trait]
impl Coordinator for RollCall {
    fn rank(&self) -> usize {
        self.inner.rank()
    }

    fn world_size(&self) -> usize {
        self.inner.world_size()
    }

    async fn all_gather(&self, data: Vec<u8>, timeout: Duration) -> Result<Vec<Vec<u8>>> {
        self.attend("all-gather", timeout, |t| self.inner.all_gather(data, t))
            .await
    }

    async fn broadcast(&self, data: Vec<u8>, root: usize, timeout: Duration) -> Result<Vec<u8>> {
        let what = format!("broadcast from rank {root}");
        self.attend(&what, timeout, |t| self.inner.broadcast(data, root, t))
            .await
    }

    async fn gather(&self, data: Vec<u8>, root: usize, timeout: Duration) -> Result<Vec<Vec<u8>>> {
        let what = format!("gather to rank {root}");
        self.attend(&what, timeout, |t| self.inner.gather(data, root, t))
            .await
    }
}
