//! The thread that owns a blocking communicator.
//!
//! Communicators whose collectives block (MPI, a Python process group that
//! needs the GIL) must not be called on a tokio worker: a blocked worker stalls
//! every other task. [`CollectiveThread`] starts one thread that creates the
//! communicator ([`BlockingCollectives`]), owns it, and makes its calls one at a
//! time in the order they were asked; the async side waits for each reply with
//! the collective's deadline. A collective that went wrong in a way that leaves
//! the ranks out of step (it missed its deadline and cannot be cancelled, or its
//! transport failed) marks the thread broken: every later call fails at once.

use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Mutex};
use std::time::Duration;

use tokio::sync::oneshot;

use crate::coord::with_deadline;
use crate::error::{Error, Result};
use crate::sync::MutexExt;

/// A communicator whose collectives block, used from the thread that created it.
pub trait BlockingCollectives {
    /// Every rank's `data`, in rank order.
    fn all_gather(&mut self, data: Vec<u8>) -> Result<Vec<Vec<u8>>>;

    /// `root`'s `data` on every rank.
    fn broadcast(&mut self, data: Vec<u8>, root: usize) -> Result<Vec<u8>>;

    /// Every rank's `data` on `root`, in rank order; an empty list elsewhere.
    /// The default all-gathers.
    fn gather(&mut self, data: Vec<u8>, root: usize, rank: usize) -> Result<Vec<Vec<u8>>> {
        let mut all = self.all_gather(data)?;
        if rank != root {
            all.clear();
        }
        Ok(all)
    }
}

enum Request {
    AllGather(Vec<u8>, oneshot::Sender<Result<Vec<Vec<u8>>>>),
    Gather(Vec<u8>, usize, usize, oneshot::Sender<Result<Vec<Vec<u8>>>>),
    Broadcast(Vec<u8>, usize, oneshot::Sender<Result<Vec<u8>>>),
}

/// One thread serving a [`BlockingCollectives`] (see the module docs).
pub struct CollectiveThread {
    label: String,
    tx: Mutex<Option<mpsc::Sender<Request>>>,
    thread: Mutex<Option<std::thread::JoinHandle<()>>>,
    broken: AtomicBool,
    breaks: fn(&Error) -> bool,
}

impl fmt::Debug for CollectiveThread {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CollectiveThread")
            .field("label", &self.label)
            .field("broken", &self.broken.load(Ordering::SeqCst))
            .finish()
    }
}

impl CollectiveThread {
    /// Start a thread called `name` that runs `open` to create the communicator
    /// (on that thread: MPI must be initialised where it is used), then serves
    /// it. Returns once `open` is done, with what it returned beside the
    /// communicator (e.g. the rank and world size). `label` names the
    /// communicator in errors; an error for which `breaks` is true marks the
    /// thread broken.
    pub fn spawn<C, R, F>(
        name: &str,
        label: impl Into<String>,
        breaks: fn(&Error) -> bool,
        open: F,
    ) -> Result<(CollectiveThread, R)>
    where
        C: BlockingCollectives,
        R: Send + 'static,
        F: FnOnce() -> Result<(C, R)> + Send + 'static,
    {
        let label = label.into();
        let (tx, rx) = mpsc::channel::<Request>();
        let (ready_tx, ready_rx) = mpsc::channel::<Result<R>>();
        let thread = std::thread::Builder::new()
            .name(name.into())
            .spawn(move || match open() {
                Err(e) => {
                    let _ = ready_tx.send(Err(e));
                }
                Ok((comm, r)) => {
                    let _ = ready_tx.send(Ok(r));
                    serve(comm, rx);
                }
            })?;
        let r = ready_rx
            .recv()
            .map_err(|_| Error::Internal(format!("the {label} thread exited while starting")))??;
        let this = CollectiveThread {
            label,
            tx: Mutex::new(Some(tx)),
            thread: Mutex::new(Some(thread)),
            broken: AtomicBool::new(false),
            breaks,
        };
        Ok((this, r))
    }

    /// Every rank's `data`, in rank order, within `timeout`.
    pub async fn all_gather(&self, data: Vec<u8>, timeout: Duration) -> Result<Vec<Vec<u8>>> {
        let (tx, rx) = oneshot::channel();
        self.send(Request::AllGather(data, tx))?;
        let what = format!("{} all-gather", self.label);
        self.check(with_deadline(&what, timeout, rx).await)
    }

    /// Every rank's `data` on `root` (this rank is `rank`), within `timeout`.
    pub async fn gather(
        &self,
        data: Vec<u8>,
        root: usize,
        rank: usize,
        timeout: Duration,
    ) -> Result<Vec<Vec<u8>>> {
        let (tx, rx) = oneshot::channel();
        self.send(Request::Gather(data, root, rank, tx))?;
        let what = format!("{} gather", self.label);
        self.check(with_deadline(&what, timeout, rx).await)
    }

    /// `root`'s `data` on every rank, within `timeout`.
    pub async fn broadcast(
        &self,
        data: Vec<u8>,
        root: usize,
        timeout: Duration,
    ) -> Result<Vec<u8>> {
        let (tx, rx) = oneshot::channel();
        self.send(Request::Broadcast(data, root, tx))?;
        let what = format!("{} broadcast", self.label);
        self.check(with_deadline(&what, timeout, rx).await)
    }

    /// Stop the thread after the calls already asked, and drop the
    /// communicator there. Waits for it unless the thread is broken (a
    /// collective that never returns would keep it forever).
    pub fn close(&self) {
        drop(self.tx.lock_unpoisoned().take());
        if !self.broken.load(Ordering::SeqCst) {
            if let Some(t) = self.thread.lock_unpoisoned().take() {
                let _ = t.join();
            }
        }
    }

    fn send(&self, req: Request) -> Result<()> {
        if self.broken.load(Ordering::SeqCst) {
            return Err(Error::Timeout(format!(
                "an earlier collective of {} failed or timed out; this job's coordination is \
                 broken (restart the job)",
                self.label
            )));
        }
        let tx = self.tx.lock_unpoisoned();
        tx.as_ref()
            .ok_or_else(|| Error::InvalidInput(format!("{} is closed", self.label)))?
            .send(req)
            .map_err(|_| Error::Internal(format!("the {} thread is gone", self.label)))
    }

    fn check<T>(&self, r: Result<T>) -> Result<T> {
        if let Err(e) = &r {
            if (self.breaks)(e) {
                self.broken.store(true, Ordering::SeqCst);
            }
        }
        r
    }
}

/// One call at a time, in the order asked; the communicator is dropped here.
fn serve<C: BlockingCollectives>(mut comm: C, rx: mpsc::Receiver<Request>) {
    while let Ok(req) = rx.recv() {
        match req {
            Request::AllGather(data, reply) => {
                let _ = reply.send(comm.all_gather(data));
            }
            Request::Gather(data, root, rank, reply) => {
                let _ = reply.send(comm.gather(data, root, rank));
            }
            Request::Broadcast(data, root, reply) => {
                let _ = reply.send(comm.broadcast(data, root));
            }
        }
    }
    drop(comm);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One rank that answers itself, and fails a broadcast from root 1.
    struct Loopback;

    impl BlockingCollectives for Loopback {
        fn all_gather(&mut self, data: Vec<u8>) -> Result<Vec<Vec<u8>>> {
            Ok(vec![data])
        }
        fn broadcast(&mut self, data: Vec<u8>, root: usize) -> Result<Vec<u8>> {
            match root {
                0 => Ok(data),
                _ => Err(Error::Timeout("peer gone".into())),
            }
        }
    }

    #[tokio::test]
    async fn serves_in_order_and_breaks() {
        let (t, rank) = CollectiveThread::spawn(
            "test-coord",
            "loopback",
            |e| matches!(e, Error::Timeout(_)),
            || Ok((Loopback, 0usize)),
        )
        .unwrap();
        assert_eq!(rank, 0);
        let d = Duration::from_secs(5);
        assert_eq!(t.all_gather(vec![1], d).await.unwrap(), vec![vec![1]]);
        assert_eq!(t.broadcast(vec![2], 0, d).await.unwrap(), vec![2]);
        assert!(t.broadcast(vec![3], 1, d).await.is_err());
        let e = t.all_gather(vec![4], d).await.unwrap_err();
        assert!(e.to_string().contains("broken"), "{e}");
        t.close();
    }
}
