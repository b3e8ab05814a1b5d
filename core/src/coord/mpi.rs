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

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use mpi::datatype::PartitionMut;
use mpi::traits::*;

use crate::coord::{BlockingCollectives, CollectiveThread, Coordinator};
use crate::error::{Error, Result};

/// A [`Coordinator`] over `MPI_COMM_WORLD`.
#[derive(Debug)]
pub struct MpiCoordinator {
    rank: usize,
    size: usize,
    thread: CollectiveThread,
}

/// `MPI_COMM_WORLD`, owned by the coordination thread. Dropped there: the
/// communicator first, then the universe (`MPI_Finalize`).
struct World {
    world: mpi::topology::SimpleCommunicator,
    _universe: mpi::environment::Universe,
}

impl BlockingCollectives for World {
    fn all_gather(&mut self, data: Vec<u8>) -> Result<Vec<Vec<u8>>> {
        all_gather(&self.world, &data)
    }

    fn broadcast(&mut self, data: Vec<u8>, root: usize) -> Result<Vec<u8>> {
        broadcast(&self.world, data, root)
    }

    fn gather(&mut self, data: Vec<u8>, root: usize, _rank: usize) -> Result<Vec<Vec<u8>>> {
        gather(&self.world, &data, root)
    }
}

impl MpiCoordinator {
    /// Initialise MPI (once per process) and start the coordination thread.
    pub fn init() -> Result<Arc<Self>> {
        // Only a missed deadline breaks it: an MPI error aborts the job anyway.
        let (thread, (rank, size)) = CollectiveThread::spawn(
            "ckpt-mpi",
            "MPI",
            |e| matches!(e, Error::Timeout(_)),
            || {
                let Some((universe, _)) = mpi::initialize_with_threading(mpi::Threading::Funneled)
                else {
                    return Err(Error::InvalidInput(
                        "MPI is already initialised in this process".into(),
                    ));
                };
                let world = universe.world();
                let ids = (world.rank() as usize, world.size() as usize);
                Ok((
                    World {
                        world,
                        _universe: universe,
                    },
                    ids,
                ))
            },
        )?;
        Ok(Arc::new(MpiCoordinator { rank, size, thread }))
    }

    /// Finalise MPI and join the coordination thread. Call before the process exits;
    /// after a timeout (a broken coordinator) it returns without waiting.
    pub fn finalize(&self) {
        self.thread.close();
    }
}

/// Where each rank's message starts in the receive buffer, and the total.
fn displacements(lens: &[i32]) -> Result<(Vec<i32>, i32)> {
    let mut displs = Vec::with_capacity(lens.len());
    let mut total = 0i32;
    for &l in lens {
        displs.push(total);
        total = total
            .checked_add(l)
            .ok_or_else(|| Error::InvalidInput("collective messages over 2 GiB".into()))?;
    }
    Ok((displs, total))
}

/// Each rank's message out of the receive buffer.
fn split(buf: &[u8], lens: &[i32], displs: &[i32]) -> Vec<Vec<u8>> {
    lens.iter()
        .zip(displs)
        .map(|(&l, &d)| buf[d as usize..(d + l) as usize].to_vec())
        .collect()
}

fn all_gather(world: &mpi::topology::SimpleCommunicator, data: &[u8]) -> Result<Vec<Vec<u8>>> {
    let size = world.size() as usize;
    let len = i32::try_from(data.len())
        .map_err(|_| Error::InvalidInput("collective message over 2 GiB".into()))?;
    let mut lens = vec![0i32; size];
    world.all_gather_into(&len, &mut lens[..]);
    let (displs, total) = displacements(&lens)?;
    if total == 0 {
        // Every rank sent nothing (a barrier): OpenMPI refuses a gather into an
        // empty buffer (MPI_ERR_ARG, fatal), and there is nothing to move.
        return Ok(vec![Vec::new(); size]);
    }
    let mut buf = vec![0u8; total as usize];
    {
        let mut part = PartitionMut::new(&mut buf[..], &lens[..], &displs[..]);
        world.all_gather_varcount_into(data, &mut part);
    }
    Ok(split(&buf, &lens, &displs))
}

fn gather(
    world: &mpi::topology::SimpleCommunicator,
    data: &[u8],
    root: usize,
) -> Result<Vec<Vec<u8>>> {
    let size = world.size() as usize;
    if root >= size {
        return Err(Error::InvalidInput(format!(
            "gather root {root} is not a rank"
        )));
    }
    let len = i32::try_from(data.len())
        .map_err(|_| Error::InvalidInput("collective message over 2 GiB".into()))?;
    let process = world.process_at_rank(root as i32);
    if world.rank() as usize != root {
        process.gather_into(&len);
        process.gather_varcount_into(data);
        return Ok(Vec::new());
    }
    let mut lens = vec![0i32; size];
    process.gather_into_root(&len, &mut lens[..]);
    let (displs, total) = displacements(&lens)?;
    // An empty receive buffer is refused by OpenMPI (see all_gather); one
    // byte more than needed is not.
    let mut buf = vec![0u8; total.max(1) as usize];
    {
        let mut part = PartitionMut::new(&mut buf[..], &lens[..], &displs[..]);
        process.gather_varcount_into_root(data, &mut part);
    }
    Ok(split(&buf, &lens, &displs))
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
        self.thread.all_gather(data, timeout).await
    }

    async fn broadcast(&self, data: Vec<u8>, root: usize, timeout: Duration) -> Result<Vec<u8>> {
        self.thread.broadcast(data, root, timeout).await
    }

    async fn gather(&self, data: Vec<u8>, root: usize, timeout: Duration) -> Result<Vec<Vec<u8>>> {
        if root >= self.size {
            return Err(Error::InvalidInput(format!(
                "gather root {root} in a job of {} ranks",
                self.size
            )));
        }
        self.thread.gather(data, root, self.rank, timeout).await
    }
}
