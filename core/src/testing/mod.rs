//! Test support (feature `testing`; never needed by a training job): the storage
//! conformance suite, the `mpirun` command the MPI tests start their ranks
//! with, the typed JSON-line reports of test jobs ([`report`]), and the seeded
//! generator of test and benchmark data ([`Xorshift`]). Failpoints are armed
//! through [`crate::failpoint`] (feature `failpoints`).

pub mod conformance;
mod mpirun;
pub mod report;
mod seeded;

pub use mpirun::mpirun;
pub use seeded::{pattern, seeded_bytes, Xorshift};
