//! Test support (feature `testing`; never needed by a training job): the storage
//! conformance suite, the `mpirun` command the MPI tests start their ranks
//! with, the typed JSON-line reports of test jobs ([`report`]), the seeded
//! generator of test and benchmark data ([`Xorshift`]), and jobs of many ranks
//! in one process ([`InProcessGroup`], counted by [`CountingCoordinator`]),
//! and the root such a job's commit publishes ([`root_of`]).
//! Failpoints are armed through [`crate::failpoint`] (feature `failpoints`).

pub mod conformance;
mod counting_coord;
mod group;
mod mpirun;
pub mod report;
mod root;
mod seeded;

pub use counting_coord::{CallCounts, CollectiveCounts, CountingCoordinator};
pub use group::InProcessGroup;
pub use mpirun::mpirun;
pub use root::root_of;
pub use seeded::{pattern, seeded_bytes, Xorshift};
