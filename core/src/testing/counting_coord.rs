//! [`CountingCoordinator`]: counts the collective calls of one rank and the
//! bytes they move, by kind, around any [`Coordinator`].
//!
//! Bytes *sent* are what this rank contributes (a broadcast's non-root ranks
//! send nothing); bytes *received* are what it gets from the other ranks (its
//! own contribution, returned by an all-gather, is not counted).

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use serde::Serialize;

use crate::coord::Coordinator;
use crate::error::Result;

/// What calls of one kind came to.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct CallCounts {
    /// Calls.
    pub calls: u64,
    /// Bytes this rank contributed.
    pub sent_bytes: u64,
    /// Bytes this rank received from the others.
    pub received_bytes: u64,
    /// The most bytes this rank received in one call.
    pub max_received_bytes: u64,
}

/// A snapshot of one rank's counts, by kind of call.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct CollectiveCounts {
    /// This rank.
    pub rank: usize,
    /// `all_gather` calls.
    pub all_gather: CallCounts,
    /// `gather` calls.
    pub gather: CallCounts,
    /// `broadcast` calls.
    pub broadcast: CallCounts,
}

impl CollectiveCounts {
    /// Calls of every kind.
    pub fn calls(&self) -> u64 {
        self.kinds().iter().map(|k| k.calls).sum()
    }

    /// Bytes sent by calls of every kind.
    pub fn sent_bytes(&self) -> u64 {
        self.kinds().iter().map(|k| k.sent_bytes).sum()
    }

    /// Bytes received by calls of every kind.
    pub fn received_bytes(&self) -> u64 {
        self.kinds().iter().map(|k| k.received_bytes).sum()
    }

    /// The most bytes received in one call of any kind.
    pub fn max_received_bytes(&self) -> u64 {
        self.kinds()
            .iter()
            .map(|k| k.max_received_bytes)
            .max()
            .unwrap_or(0)
    }

    fn kinds(&self) -> [CallCounts; 3] {
        [self.all_gather, self.gather, self.broadcast]
    }
}

#[derive(Debug, Default)]
struct Counter {
    calls: AtomicU64,
    sent: AtomicU64,
    received: AtomicU64,
    max_received: AtomicU64,
}

impl Counter {
    fn add(&self, sent: usize, received: usize) {
        self.calls.fetch_add(1, Ordering::Relaxed);
        self.sent.fetch_add(sent as u64, Ordering::Relaxed);
        self.received.fetch_add(received as u64, Ordering::Relaxed);
        self.max_received
            .fetch_max(received as u64, Ordering::Relaxed);
    }

    fn get(&self) -> CallCounts {
        CallCounts {
            calls: self.calls.load(Ordering::Relaxed),
            sent_bytes: self.sent.load(Ordering::Relaxed),
            received_bytes: self.received.load(Ordering::Relaxed),
            max_received_bytes: self.max_received.load(Ordering::Relaxed),
        }
    }

    fn reset(&self) {
        for a in [&self.calls, &self.sent, &self.received, &self.max_received] {
            a.store(0, Ordering::Relaxed);
        }
    }
}

/// Wraps one rank's [`Coordinator`] and counts its calls (successful ones:
/// a failed call moved nothing this rank can account for).
pub struct CountingCoordinator {
    inner: Arc<dyn Coordinator>,
    all_gather: Counter,
    gather: Counter,
    broadcast: Counter,
}

impl fmt::Debug for CountingCoordinator {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CountingCoordinator")
            .field("inner", &self.inner)
            .field("counts", &self.snapshot())
            .finish()
    }
}

impl CountingCoordinator {
    /// Count the calls made through `inner`.
    pub fn new(inner: Arc<dyn Coordinator>) -> CountingCoordinator {
        CountingCoordinator {
            inner,
            all_gather: Counter::default(),
            gather: Counter::default(),
            broadcast: Counter::default(),
        }
    }

    /// The counts so far.
    pub fn snapshot(&self) -> CollectiveCounts {
        CollectiveCounts {
            rank: self.inner.rank(),
            all_gather: self.all_gather.get(),
            gather: self.gather.get(),
            broadcast: self.broadcast.get(),
        }
    }

    /// Start counting from zero.
    pub fn reset(&self) {
        self.all_gather.reset();
        self.gather.reset();
        self.broadcast.reset();
    }
}

/// Bytes of `all` that came from ranks other than `me`.
fn from_others(all: &[Vec<u8>], me: usize) -> usize {
    all.iter()
        .enumerate()
        .filter(|(r, _)| *r != me)
        .map(|(_, b)| b.len())
        .sum()
}

#[async_trait]
impl Coordinator for CountingCoordinator {
    fn rank(&self) -> usize {
        self.inner.rank()
    }

    fn world_size(&self) -> usize {
        self.inner.world_size()
    }

    async fn all_gather(&self, data: Vec<u8>, timeout: Duration) -> Result<Vec<Vec<u8>>> {
        let sent = data.len();
        let all = self.inner.all_gather(data, timeout).await?;
        self.all_gather.add(sent, from_others(&all, self.rank()));
        Ok(all)
    }

    async fn broadcast(&self, data: Vec<u8>, root: usize, timeout: Duration) -> Result<Vec<u8>> {
        let root_here = self.rank() == root;
        let sent = if root_here { data.len() } else { 0 };
        let got = self.inner.broadcast(data, root, timeout).await?;
        self.broadcast
            .add(sent, if root_here { 0 } else { got.len() });
        Ok(got)
    }

    async fn gather(&self, data: Vec<u8>, root: usize, timeout: Duration) -> Result<Vec<Vec<u8>>> {
        let sent = data.len();
        let all = self.inner.gather(data, root, timeout).await?;
        self.gather.add(sent, from_others(&all, self.rank()));
        Ok(all)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::InProcessGroup;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn counts_calls_and_bytes_by_kind_per_rank() {
        let t = Duration::from_secs(10);
        let ranks: Vec<Arc<CountingCoordinator>> = InProcessGroup::new(3)
            .into_iter()
            .map(|g| Arc::new(CountingCoordinator::new(g)))
            .collect();
        let tasks: Vec<_> = ranks
            .iter()
            .cloned()
            .map(|c| {
                tokio::spawn(async move {
                    // Rank r contributes r + 1 bytes.
                    let mine = vec![0u8; c.rank() + 1];
                    c.all_gather(mine.clone(), t).await.unwrap();
                    c.all_gather(mine.clone(), t).await.unwrap();
                    c.gather(mine, 0, t).await.unwrap();
                    c.broadcast(vec![0; 10], 2, t).await.unwrap();
                })
            })
            .collect();
        for task in tasks {
            task.await.unwrap();
        }
        let c0 = ranks[0].snapshot();
        assert_eq!(c0.rank, 0);
        // Two all-gathers: 1 byte sent, 2 + 3 received, each.
        assert_eq!(
            c0.all_gather,
            CallCounts {
                calls: 2,
                sent_bytes: 2,
                received_bytes: 10,
                max_received_bytes: 5
            }
        );
        // The root of the gather receives the others' 5 bytes; rank 1 nothing.
        assert_eq!((c0.gather.sent_bytes, c0.gather.received_bytes), (1, 5));
        let c1 = ranks[1].snapshot();
        assert_eq!((c1.gather.sent_bytes, c1.gather.received_bytes), (2, 0));
        assert_eq!(
            (c1.all_gather.received_bytes, c1.max_received_bytes()),
            (8, 10)
        );
        // The broadcast's root sends 10 bytes and receives none; the others the reverse.
        let c2 = ranks[2].snapshot();
        assert_eq!(
            (c2.broadcast.sent_bytes, c2.broadcast.received_bytes),
            (10, 0)
        );
        assert_eq!(
            (c0.broadcast.sent_bytes, c0.broadcast.received_bytes),
            (0, 10)
        );
        assert_eq!(c0.calls(), 4);
        assert_eq!(c0.sent_bytes(), 3);
        assert_eq!(c0.received_bytes(), 25);
        ranks[0].reset();
        assert_eq!(
            ranks[0].snapshot(),
            CollectiveCounts {
                rank: 0,
                ..Default::default()
            }
        );
        // The other ranks' counters are their own.
        assert_eq!(ranks[1].snapshot().calls(), 4);
    }
}
