//! An in-process [`Coordinator`]: `size` ranks as tasks of one process, exchanging
//! bytes through shared memory. It lets the determinism experiment save one state
//! from several ranks without MPI (the real multi-process runs belong to the scale
//! experiment, under `mpirun`).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use ckpt_core::sync::MutexExt;
use ckpt_core::{Coordinator, Error, Result};

#[derive(Debug, Default)]
struct Shared {
    /// Per collective round, each rank's contribution.
    rounds: Mutex<HashMap<u64, Vec<Option<Vec<u8>>>>>,
    notify: tokio::sync::Notify,
}

/// One rank of an in-process group.
#[derive(Debug)]
pub struct LocalGroup {
    rank: usize,
    size: usize,
    next_round: AtomicU64,
    shared: Arc<Shared>,
}

impl LocalGroup {
    /// The ranks of a group of `size`, in rank order.
    pub fn new(size: usize) -> Vec<Arc<LocalGroup>> {
        let shared = Arc::new(Shared::default());
        (0..size)
            .map(|rank| {
                Arc::new(LocalGroup {
                    rank,
                    size,
                    next_round: AtomicU64::new(0),
                    shared: shared.clone(),
                })
            })
            .collect()
    }

    /// Contribute `data` to the next round and wait for every rank's contribution.
    async fn exchange(&self, data: Vec<u8>, timeout: Duration) -> Result<Vec<Vec<u8>>> {
        let round = self.next_round.fetch_add(1, Ordering::SeqCst);
        let deadline = Instant::now() + timeout;
        {
            let mut rounds = self.shared.rounds.lock_unpoisoned();
            rounds.entry(round).or_insert_with(|| vec![None; self.size])[self.rank] = Some(data);
        }
        self.shared.notify.notify_waiters();
        loop {
            let notified = self.shared.notify.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            {
                let rounds = self.shared.rounds.lock_unpoisoned();
                let slots = &rounds[&round];
                if slots.iter().all(Option::is_some) {
                    return Ok(slots.iter().flatten().cloned().collect());
                }
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if tokio::time::timeout(left, notified).await.is_err() {
                return Err(Error::Internal(format!(
                    "rank {} timed out in collective round {round}",
                    self.rank
                )));
            }
        }
    }
}

#[async_trait]
impl Coordinator for LocalGroup {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.size
    }

    async fn all_gather(&self, data: Vec<u8>, timeout: Duration) -> Result<Vec<Vec<u8>>> {
        self.exchange(data, timeout).await
    }

    async fn broadcast(&self, data: Vec<u8>, root: usize, timeout: Duration) -> Result<Vec<u8>> {
        if root >= self.size {
            return Err(Error::InvalidInput(format!(
                "broadcast root {root} in a group of {}",
                self.size
            )));
        }
        let mine = if self.rank == root { data } else { Vec::new() };
        let mut all = self.exchange(mine, timeout).await?;
        Ok(all.swap_remove(root))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn gather_and_broadcast_across_ranks() {
        let ranks = LocalGroup::new(3);
        let t = Duration::from_secs(5);
        let tasks: Vec<_> = ranks
            .iter()
            .cloned()
            .map(|g| {
                tokio::spawn(async move {
                    let all = g.all_gather(vec![g.rank() as u8], t).await.unwrap();
                    let b = g.broadcast(vec![10 + g.rank() as u8], 1, t).await.unwrap();
                    (all, b)
                })
            })
            .collect();
        for task in tasks {
            let (all, b) = task.await.unwrap();
            assert_eq!(all, vec![vec![0], vec![1], vec![2]]);
            assert_eq!(b, vec![11]);
        }
    }

    #[tokio::test]
    async fn a_missing_rank_times_out() {
        let ranks = LocalGroup::new(2);
        let r = ranks[0]
            .all_gather(vec![1], Duration::from_millis(50))
            .await;
        assert!(matches!(r, Err(Error::Internal(_))), "{r:?}");
    }
}
