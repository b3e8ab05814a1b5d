//! Test support (feature `testing`; never needed by a training job): the storage
//! conformance suite and the `mpirun` command the MPI tests start their ranks
//! with. Failpoints are armed through [`crate::failpoint`] (feature `failpoints`).

pub mod conformance;
mod mpirun;

pub use mpirun::mpirun;
