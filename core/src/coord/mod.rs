//! Coordination between the ranks of a job.
//!
//! The engine needs three collective operations, all on small byte messages:
//! all-gather, gather to one rank, and broadcast. A save gathers what it
//! needs to rank 0 and broadcasts the outcome, so no rank but rank 0 receives
//! more as the job grows. [`Coordinator`] is that interface; [`Solo`] is
//! the single-process one, and [`MpiCoordinator`] the one over MPI (feature `mpi`).
//!
//! Every call has a deadline: a rank that died or never arrives makes the others
//! fail with [`Error::Timeout`] instead of hanging; a checkpointer's
//! collectives go through [`RollCall`], which names those ranks
//! ([`Error::Stragglers`]).

use std::fmt;
use std::time::Duration;

use async_trait::async_trait;

use crate::error::{Error, Result};

#[cfg(feature = "mpi")]
mod mpi;
mod roll_call;
mod thread;

#[cfg(feature = "mpi")]
pub use mpi::MpiCoordinator;
pub use roll_call::RollCall;
pub use thread::{BlockingCollectives, CollectiveThread};

/// The collective operations the engine uses. Every rank must call them in the same
/// order; the engine guarantees that by running the collective part of saves one at a
/// time, in the order the saves were started.
#[async_trait]
pub trait Coordinator: Send + Sync + fmt::Debug {
    /// This process's rank, `0..world_size()`.
    fn rank(&self) -> usize;

    /// Number of ranks.
    fn world_size(&self) -> usize;

    /// Every rank contributes `data`; every rank receives all contributions, in rank order.
    async fn all_gather(&self, data: Vec<u8>, timeout: Duration) -> Result<Vec<Vec<u8>>>;

    /// `root` sends `data` (ignored on other ranks); every rank receives it.
    async fn broadcast(&self, data: Vec<u8>, root: usize, timeout: Duration) -> Result<Vec<u8>>;

    /// Every rank contributes `data`; `root` receives all contributions, in
    /// rank order, and every other rank an empty list. What a commit uses, so
    /// a rank receives O(1) bytes however many ranks there are. The default
    /// all-gathers (correct, not cheap); communicators with a gather override it.
    async fn gather(&self, data: Vec<u8>, root: usize, timeout: Duration) -> Result<Vec<Vec<u8>>> {
        if root >= self.world_size() {
            return Err(Error::InvalidInput(format!(
                "gather root {root} in a job of {} ranks",
                self.world_size()
            )));
        }
        let mut all = self.all_gather(data, timeout).await?;
        if self.rank() != root {
            all.clear();
        }
        Ok(all)
    }
}

/// A job of one process.
#[derive(Debug, Clone, Copy, Default)]
pub struct Solo;

#[async_trait]
impl Coordinator for Solo {
    fn rank(&self) -> usize {
        0
    }

    fn world_size(&self) -> usize {
        1
    }

    async fn all_gather(&self, data: Vec<u8>, _timeout: Duration) -> Result<Vec<Vec<u8>>> {
        Ok(vec![data])
    }

    async fn broadcast(&self, data: Vec<u8>, root: usize, _timeout: Duration) -> Result<Vec<u8>> {
        if root != 0 {
            return Err(Error::InvalidInput(format!(
                "broadcast root {root} in a job of one rank"
            )));
        }
        Ok(data)
    }
}

/// Run a blocking collective on a dedicated thread and wait for it with a deadline.
///
/// Used by implementations whose collectives block (MPI): on a timeout the thread is
/// left behind (the collective cannot be cancelled) and the error says so.
pub(crate) async fn with_deadline<T: Send + 'static>(
    what: &str,
    timeout: Duration,
    rx: tokio::sync::oneshot::Receiver<Result<T>>,
) -> Result<T> {
    match tokio::time::timeout(timeout, rx).await {
        Ok(Ok(r)) => r,
        Ok(Err(_)) => Err(Error::Internal(format!(
            "{what}: the coordination thread is gone"
        ))),
        Err(_) => Err(Error::Timeout(format!(
            "{what} did not complete within {timeout:?}: a rank died or stopped taking part"
        ))),
    }
}
