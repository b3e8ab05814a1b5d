//! Coordination over MPI (feature `mpi`; OpenMPI through the `mpi` crate).
//!
//! MPI is initialised on a dedicated thread that owns the communicator and makes
//! every MPI call (`MPI_THREAD_FUNNELED`); the engine's async tasks send it work
//! and wait with a deadline. A collective that misses its deadline (a rank died)
//! cannot be cancelled: the coordinator is then marked broken, every later call
//! fails at once, and the process should exit.
//!
//! ```no_run
//! # async fn demo(format: std::sync::Arc<dyn ckpt_core::Format>) -> ckpt_core::Result<()> {
//! let coord = ckpt_core::coord::MpiCoordinator::init()?;
//! let cp = ckpt_core::Checkpointer::builder("file:///shared/run")
//!     .coordinator(coord.clone())
//!     .format(format)
//!     .build()
//!     .await?;
//! // ... train, cp.save(step, state) on every rank ...
//! drop(cp);
//! coord.finalize(); // MPI_Finalize, before the process exits
//! # Ok(()) }
//! ```

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use mpi::datatype::PartitionMut;
use mpi::traits::*;
use tokio::sync::oneshot;

use crate::coord::{with_deadline, Coordinator};
use crate::error::{Error, Result};

enum Job {
    AllGather(Vec<u8>, oneshot::Sender<Result<Vec<Vec<u8>>>>),
    Broadcast(Vec<u8>, usize, oneshot::Sender<Result<Vec<u8>>>),
    Finalize,
}

/// A [`Coordinator`] over `MPI_COMM_WORLD`.
#[derive(Debug)]
pub struct MpiCoordinator {
    rank: usize,
    size: usize,
    tx: Mutex<Option<mpsc::Sender<Job>>>,
    thread: Mutex<Option<std::thread::JoinHandle<()>>>,
    broken: AtomicBool,
}

impl std::fmt::Debug for Job {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Job::AllGather(..) => "AllGather",
            Job::Broadcast(..) => "Broadcast",
            Job::Finalize => "Finalize",
        })
    }
}

impl MpiCoordinator {
    /// Initialise MPI (once per process) and start the coordination thread.
    pub fn init() -> Result<Arc<Self>> {
        let (tx, rx) = mpsc::channel::<Job>();
        let (ready_tx, ready_rx) = mpsc::channel::<Result<(usize, usize)>>();
        let thread = std::thread::Builder::new()
            .name("ckpt-mpi".into())
            .spawn(move || {
                let Some((universe, _)) = mpi::initialize_with_threading(mpi::Threading::Funneled)
                else {
                    let _ = ready_tx.send(Err(Error::InvalidInput(
                        "MPI is already initialised in this process".into(),
                    )));
                    return;
                };
                let world = universe.world();
                let _ = ready_tx.send(Ok((world.rank() as usize, world.size() as usize)));
                serve(&world, rx);
                drop(universe); // MPI_Finalize
            })?;
        let (rank, size) = ready_rx
            .recv()
            .map_err(|_| Error::Internal("the MPI thread exited during initialisation".into()))??;
        Ok(Arc::new(MpiCoordinator {
            rank,
            size,
            tx: Mutex::new(Some(tx)),
            thread: Mutex::new(Some(thread)),
            broken: AtomicBool::new(false),
        }))
    }

    /// Finalise MPI and join the coordination thread. Call before the process exits;
    /// after a timeout (a broken coordinator) it returns without waiting.
    pub fn finalize(&self) {
        let tx = self.tx.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(tx) = tx {
            let _ = tx.send(Job::Finalize);
        }
        if !self.broken.load(Ordering::SeqCst) {
            if let Some(t) = self.thread.lock().unwrap_or_else(|p| p.into_inner()).take() {
                let _ = t.join();
            }
        }
    }

    fn send(&self, job: Job) -> Result<()> {
        if self.broken.load(Ordering::SeqCst) {
            return Err(Error::Timeout(
                "an earlier collective timed out; MPI coordination is broken".into(),
            ));
        }
        let tx = self.tx.lock().unwrap_or_else(|p| p.into_inner());
        tx.as_ref()
            .ok_or_else(|| Error::InvalidInput("MPI is finalised".into()))?
            .send(job)
            .map_err(|_| Error::Internal("the MPI thread is gone".into()))
    }

    fn check<T>(&self, r: Result<T>) -> Result<T> {
        if matches!(r, Err(Error::Timeout(_))) {
            self.broken.store(true, Ordering::SeqCst);
        }
        r
    }
}

fn serve(world: &mpi::topology::SimpleCommunicator, rx: mpsc::Receiver<Job>) {
    while let Ok(job) = rx.recv() {
        match job {
            Job::AllGather(data, reply) => {
                let _ = reply.send(all_gather(world, &data));
            }
            Job::Broadcast(data, root, reply) => {
                let _ = reply.send(broadcast(world, data, root));
            }
            Job::Finalize => return,
        }
    }
}

fn all_gather(world: &mpi::topology::SimpleCommunicator, data: &[u8]) -> Result<Vec<Vec<u8>>> {
    let size = world.size() as usize;
    let len = i32::try_from(data.len())
        .map_err(|_| Error::InvalidInput("collective message over 2 GiB".into()))?;
    let mut lens = vec![0i32; size];
    world.all_gather_into(&len, &mut lens[..]);
    let mut displs = Vec::with_capacity(size);
    let mut total = 0i32;
    for &l in &lens {
        displs.push(total);
        total = total
            .checked_add(l)
            .ok_or_else(|| Error::InvalidInput("collective messages over 2 GiB".into()))?;
    }
    let mut buf = vec![0u8; total as usize];
    {
        let mut part = PartitionMut::new(&mut buf[..], &lens[..], &displs[..]);
        world.all_gather_varcount_into(data, &mut part);
    }
    Ok(lens
        .iter()
        .zip(&displs)
        .map(|(&l, &d)| buf[d as usize..(d + l) as usize].to_vec())
        .collect())
}

fn broadcast(
    world: &mpi::topology::SimpleCommunicator,
    data: Vec<u8>,
    root: usize,
) -> Result<Vec<u8>> {
    if root >= world.size() as usize {
        return Err(Error::InvalidInput(format!(
            "broadcast root {root} is not a rank"
        )));
    }
    let process = world.process_at_rank(root as i32);
    let mut len = data.len() as u64;
    process.broadcast_into(&mut len);
    let mut buf = if world.rank() as usize == root {
        data
    } else {
        vec![0u8; len as usize]
    };
    process.broadcast_into(&mut buf[..]);
    Ok(buf)
}

#[async_trait]
impl Coordinator for MpiCoordinator {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.size
    }

    async fn all_gather(&self, data: Vec<u8>, timeout: Duration) -> Result<Vec<Vec<u8>>> {
        let (tx, rx) = oneshot::channel();
        self.send(Job::AllGather(data, tx))?;
        self.check(with_deadline("MPI all-gather", timeout, rx).await)
    }

    async fn broadcast(&self, data: Vec<u8>, root: usize, timeout: Duration) -> Result<Vec<u8>> {
        let (tx, rx) = oneshot::channel();
        self.send(Job::Broadcast(data, root, tx))?;
        self.check(with_deadline("MPI broadcast", timeout, rx).await)
    }
}
