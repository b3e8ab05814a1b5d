//! [`InProcessGroup`]: a [`Coordinator`] whose ranks are tasks of one process,
//! for tests and simulations of jobs of many ranks (thousands) in one runtime.
//!
//! Each collective call is a *round*, numbered alike on every rank (every rank
//! calls the collectives in the same order). A round holds one slot per rank
//! and an arrival counter; the rank whose arrival completes it assembles the
//! result once, as an `Arc`, and wakes the waiters once. No arrival scans the
//! slots or wakes anyone else, so a round costs O(ranks) in all, not O(ranks²).
//! Each rank then copies what it receives out of the shared result (the
//! [`Coordinator`] methods return owned buffers); a gather's root takes the
//! contributions without a copy.
//!
//! A rank that does not arrive within the deadline makes every waiting rank
//! fail with [`Error::Timeout`] naming the missing ranks.

use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use tokio::sync::watch;

use crate::coord::Coordinator;
use crate::error::{Error, Result};
use crate::sync::MutexExt;

/// Missing ranks named in a timeout before the rest are only counted.
const NAMED: usize = 8;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    AllGather,
    Gather(usize),
    Broadcast(usize),
}

impl fmt::Display for Kind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Kind::AllGather => write!(f, "all_gather"),
            Kind::Gather(r) => write!(f, "gather to rank {r}"),
            Kind::Broadcast(r) => write!(f, "broadcast from rank {r}"),
        }
    }
}

/// One collective call, as every rank sees it.
struct Round {
    kind: Kind,
    /// Each rank's contribution; `Some` once it arrived.
    slots: Vec<Mutex<Option<Vec<u8>>>>,
    arrived: AtomicUsize,
    /// Ranks that have read the result: the last one takes it.
    read: AtomicUsize,
    /// Set by the last arrival: the contributions in rank order (a broadcast:
    /// the root's alone).
    result: Mutex<Option<Arc<Vec<Vec<u8>>>>>,
    done: watch::Sender<bool>,
}

impl Round {
    fn new(kind: Kind, size: usize) -> Round {
        Round {
            kind,
            slots: (0..size).map(|_| Mutex::new(None)).collect(),
            arrived: AtomicUsize::new(0),
            read: AtomicUsize::new(0),
            result: Mutex::new(None),
            done: watch::Sender::new(false),
        }
    }

    /// The ranks that have not arrived: the first few, and how many in all.
    fn missing(&self) -> String {
        let missing: Vec<usize> = self
            .slots
            .iter()
            .enumerate()
            .filter(|(_, s)| s.lock_unpoisoned().is_none())
            .map(|(r, _)| r)
            .collect();
        let named: Vec<String> = missing.iter().take(NAMED).map(|r| r.to_string()).collect();
        let more = if missing.len() > NAMED { ", ..." } else { "" };
        format!(
            "rank(s) {}{more} ({} of {} in all) did not arrive",
            named.join(", "),
            missing.len(),
            self.slots.len()
        )
    }
}

#[derive(Default)]
struct Shared {
    /// Rounds some rank has entered and that are not complete.
    open: Mutex<HashMap<u64, Arc<Round>>>,
}

/// One rank of an in-process group of tasks.
pub struct InProcessGroup {
    rank: usize,
    size: usize,
    next_round: AtomicU64,
    shared: Arc<Shared>,
}

impl fmt::Debug for InProcessGroup {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("InProcessGroup")
            .field("rank", &self.rank)
            .field("size", &self.size)
            .finish()
    }
}

impl InProcessGroup {
    /// The ranks of a group of `size` (at least 1), in rank order.
    pub fn new(size: usize) -> Vec<Arc<InProcessGroup>> {
        let shared = Arc::new(Shared::default());
        (0..size.max(1))
            .map(|rank| {
                Arc::new(InProcessGroup {
                    rank,
                    size: size.max(1),
                    next_round: AtomicU64::new(0),
                    shared: shared.clone(),
                })
            })
            .collect()
    }

    fn check_root(&self, root: usize, what: &str) -> Result<()> {
        if root >= self.size {
            return Err(Error::InvalidInput(format!(
                "{what} root {root} in a group of {}",
                self.size
            )));
        }
        Ok(())
    }

    /// Put `data` in this rank's slot of the next round. Returns the round,
    /// with its result when this arrival completed it.
    fn arrive(&self, kind: Kind, data: Vec<u8>) -> Result<(u64, Arc<Round>)> {
        let n = self.next_round.fetch_add(1, Ordering::Relaxed);
        let round = self
            .shared
            .open
            .lock_unpoisoned()
            .entry(n)
            .or_insert_with(|| Arc::new(Round::new(kind, self.size)))
            .clone();
        if round.kind != kind {
            return Err(Error::Internal(format!(
                "collective round {n}: rank {} called {kind} where another rank called {}; \
                 every rank must call the collectives in the same order",
                self.rank, round.kind
            )));
        }
        *round.slots[self.rank].lock_unpoisoned() = Some(data);
        if round.arrived.fetch_add(1, Ordering::AcqRel) + 1 == self.size {
            self.complete(n, &round);
        }
        Ok((n, round))
    }

    /// The last arrival: take every contribution, publish them, wake the waiters.
    fn complete(&self, n: u64, round: &Round) {
        self.shared.open.lock_unpoisoned().remove(&n);
        let taken = |r: usize| round.slots[r].lock_unpoisoned().take().unwrap_or_default();
        let result = match round.kind {
            Kind::Broadcast(root) => vec![taken(root)],
            _ => (0..self.size).map(taken).collect(),
        };
        // Slots keep an empty contribution: arrived, for a later timeout message.
        for s in &round.slots {
            s.lock_unpoisoned().get_or_insert_with(Vec::new);
        }
        *round.result.lock_unpoisoned() = Some(Arc::new(result));
        round.done.send_replace(true);
    }

    /// Wait for `round` to complete; its result. The last of `readers` ranks
    /// to read it takes the round's reference, so that it can own the result
    /// once the others have copied theirs.
    async fn finished(
        &self,
        n: u64,
        round: &Round,
        readers: usize,
        timeout: Duration,
    ) -> Result<Arc<Vec<Vec<u8>>>> {
        let mut rx = round.done.subscribe();
        if tokio::time::timeout(timeout, rx.wait_for(|d| *d))
            .await
            .is_err()
        {
            return Err(Error::Timeout(format!(
                "{} (collective round {n}) at rank {}: {} within {timeout:?}",
                round.kind,
                self.rank,
                round.missing()
            )));
        }
        let mut slot = round.result.lock_unpoisoned();
        let last = round.read.fetch_add(1, Ordering::AcqRel) + 1 == readers;
        let result = if last { slot.take() } else { slot.clone() };
        result.ok_or_else(|| Error::Internal(format!("collective round {n}: no result")))
    }
}

#[async_trait]
impl Coordinator for InProcessGroup {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.size
    }

    async fn all_gather(&self, data: Vec<u8>, timeout: Duration) -> Result<Vec<Vec<u8>>> {
        let (n, round) = self.arrive(Kind::AllGather, data)?;
        let all = self.finished(n, &round, self.size, timeout).await?;
        drop(round);
        // The last rank to read takes the result if the others are done with it.
        Ok(Arc::try_unwrap(all).unwrap_or_else(|a| (*a).clone()))
    }

    async fn broadcast(&self, data: Vec<u8>, root: usize, timeout: Duration) -> Result<Vec<u8>> {
        self.check_root(root, "broadcast")?;
        let mine = if self.rank == root { data } else { Vec::new() };
        let (n, round) = self.arrive(Kind::Broadcast(root), mine)?;
        let all = self.finished(n, &round, self.size, timeout).await?;
        drop(round);
        Ok(match Arc::try_unwrap(all) {
            Ok(mut v) => v.pop().unwrap_or_default(),
            Err(a) => a.first().cloned().unwrap_or_default(),
        })
    }

    /// Only `root` waits and receives; every other rank leaves its
    /// contribution and returns an empty list at once (as an MPI gather's
    /// sender may).
    async fn gather(&self, data: Vec<u8>, root: usize, timeout: Duration) -> Result<Vec<Vec<u8>>> {
        self.check_root(root, "gather")?;
        let (n, round) = self.arrive(Kind::Gather(root), data)?;
        if self.rank != root {
            return Ok(Vec::new());
        }
        let all = self.finished(n, &round, 1, timeout).await?;
        Ok(Arc::try_unwrap(all).unwrap_or_else(|a| (*a).clone()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every rank: an all-gather of its rank, a gather to the last rank, a
    /// broadcast from rank 1. What each rank received.
    async fn three_collectives(size: usize) -> Vec<(Vec<Vec<u8>>, Vec<Vec<u8>>, Vec<u8>)> {
        let t = Duration::from_secs(60);
        let tasks: Vec<_> = InProcessGroup::new(size)
            .into_iter()
            .map(|g| {
                tokio::spawn(async move {
                    let me = (g.rank() as u32).to_le_bytes().to_vec();
                    let all = g.all_gather(me.clone(), t).await.unwrap();
                    let gathered = g.gather(me, size - 1, t).await.unwrap();
                    let b = g.broadcast(vec![7, g.rank() as u8], 1, t).await.unwrap();
                    (all, gathered, b)
                })
            })
            .collect();
        let mut out = Vec::new();
        for task in tasks {
            out.push(task.await.unwrap());
        }
        out
    }

    fn ranks(size: usize) -> Vec<Vec<u8>> {
        (0..size as u32).map(|r| r.to_le_bytes().to_vec()).collect()
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn collectives_of_three_ranks() {
        let got = three_collectives(3).await;
        for (rank, (all, gathered, b)) in got.into_iter().enumerate() {
            assert_eq!(all, ranks(3));
            if rank == 2 {
                assert_eq!(gathered, ranks(3));
            } else {
                assert!(gathered.is_empty());
            }
            assert_eq!(b, vec![7, 1]);
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn collectives_of_4096_ranks() {
        let size = 4096;
        let got = three_collectives(size).await;
        let want = ranks(size);
        for (rank, (all, gathered, b)) in got.into_iter().enumerate() {
            assert_eq!(all, want, "rank {rank}");
            assert_eq!(gathered.is_empty(), rank != size - 1);
            assert_eq!(b, vec![7, 1]);
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn gather_and_broadcast_of_16384_ranks() {
        // What a commit by gather needs: rank 0 receives every rank's
        // bytes, every rank the outcome; no rank receives O(ranks) otherwise.
        let size = 16384;
        let t = Duration::from_secs(120);
        let tasks: Vec<_> = InProcessGroup::new(size)
            .into_iter()
            .map(|g| {
                tokio::spawn(async move {
                    let me = (g.rank() as u32).to_le_bytes().to_vec();
                    let got = g.gather(me, 0, t).await.unwrap();
                    let b = g.broadcast(vec![9; 32], 0, t).await.unwrap();
                    (got, b)
                })
            })
            .collect();
        for (rank, task) in tasks.into_iter().enumerate() {
            let (got, b) = task.await.unwrap();
            if rank == 0 {
                assert_eq!(got, ranks(size));
            } else {
                assert!(got.is_empty());
            }
            assert_eq!(b, vec![9; 32]);
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_missing_rank_is_named_on_every_waiting_rank() {
        let mut g = InProcessGroup::new(4);
        let _absent = g.remove(2);
        let tasks: Vec<_> = g
            .into_iter()
            .map(|g| {
                tokio::spawn(async move { g.all_gather(vec![1], Duration::from_millis(100)).await })
            })
            .collect();
        for task in tasks {
            match task.await.unwrap() {
                Err(Error::Timeout(m)) => {
                    assert!(
                        m.contains("rank(s) 2 (1 of 4 in all) did not arrive"),
                        "{m}"
                    )
                }
                other => panic!("expected a timeout, got {other:?}"),
            }
        }
    }

    #[tokio::test]
    async fn a_gather_root_names_the_missing_ranks_and_others_do_not_wait() {
        let g = InProcessGroup::new(20);
        // Ranks 1..10 contribute; 10..20 never come.
        for r in &g[1..10] {
            assert!(r
                .gather(vec![1], 0, Duration::ZERO)
                .await
                .unwrap()
                .is_empty());
        }
        match g[0].gather(vec![0], 0, Duration::from_millis(50)).await {
            Err(Error::Timeout(m)) => assert!(
                m.contains("rank(s) 10, 11, 12, 13, 14, 15, 16, 17, ... (10 of 20 in all)"),
                "{m}"
            ),
            other => panic!("expected a timeout, got {other:?}"),
        }
    }

    #[tokio::test]
    async fn ranks_out_of_step_are_an_error_not_a_hang() {
        let g = InProcessGroup::new(2);
        // Rank 0 broadcasts in round 0 (and times out waiting for rank 1).
        let _ = g[0].broadcast(vec![1], 0, Duration::from_millis(1)).await;
        let r = g[1].all_gather(vec![2], Duration::from_secs(5)).await;
        assert!(matches!(r, Err(Error::Internal(_))), "{r:?}");
        assert!(g[1].broadcast(vec![], 5, Duration::ZERO).await.is_err());
    }
}
