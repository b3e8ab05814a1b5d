//! A save, from the call to the commit.
//!
//! - [`handle`]: `Checkpointer::save`: checks, then the snapshot (the only stall),
//!   then the persist task is spawned; the [`SaveHandle`] the caller waits on.
//! - [`snapshot`]: what `save` is given ([`Capture`]) and the copy into staging;
//!   [`copy`]: those copies spread over threads, large sources cut in pieces.
//! - [`shared`]: one snapshot saved by two checkpointers ([`SharedSnapshot`]).
//! - [`slab`]: [`Slab`], host memory filled from outside (a GPU's
//!   device-to-host copies) and saved without a copy.
//! - [`persist`]: the background half: the plan, this rank's writes through the
//!   format, and the coordinated commit (manifest last).
//! - [`gc`]: retention and GC, after a commit and on request (`Checkpointer::gc`);
//!   [`discard`]: the checkpoints after a step, discarded on request (a rollback).
//! - [`plan`]: which rank writes which tensor (pure).
//! - [`report`]: the [`SaveReport`] a committed save returns.
//!
//! Dependencies run one way: `handle` → `persist` → `plan`, `persist` → `gc`,
//! and `handle` and `persist` use `snapshot` and `report`; `snapshot` and
//! `slab` fill buffers of [`crate::staging`].

pub(crate) mod copy;
pub(crate) mod discard;
pub(crate) mod exchange;
pub(crate) mod gc;
pub(crate) mod handle;
pub(crate) mod persist;
pub(crate) mod plan;
pub(crate) mod report;
pub(crate) mod shared;
pub(crate) mod slab;
pub(crate) mod snapshot;

pub use handle::SaveHandle;
pub use report::SaveReport;
pub use shared::{LaterSnapshot, SharedSnapshot};
pub use slab::Slab;
pub use snapshot::{Capture, CopySource, Ready, SharedVec, SourceTensor, TensorData};
