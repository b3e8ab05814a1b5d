//! # ckpt-core
//!
//! The data model, async engine, storage and commit protocol of **ckpt**, a
//! fault-tolerant checkpointing library for deep-learning training.
//!
//! - [`State`] / [`Tensor`] / [`Value`]: what a checkpoint holds (no pickle: non-tensor
//!   state is plain data).
//! - [`Checkpointer`]: `save` snapshots the state (the only stall) and persists it in
//!   the background; `load_latest` finds the newest checkpoint that is committed and
//!   intact, skipping damaged ones.
//! - [`Format`]: the small trait through which on-storage formats (in `ckpt-formats`)
//!   lay tensors out; [`Manifest`]: the commit record, published last.
//! - Storage is any [`object_store::ObjectStore`], opened by URL ([`store::open_url`]).
//!   [`TieredCheckpointStore`] writes on a fast tier and flushes to a durable one.
//! - [`layout`]: the keys under a root and the reads tools need; [`coord`]: the
//!   ranks of a job.
//! - Test support is behind features: `failpoints` ([`failpoint`]) and `testing`
//!   (the storage conformance suite, `mpirun`, seeded test data, the
//!   fault-injecting `store::FaultStore`).
//!
//! ```
//! # async fn demo(format: std::sync::Arc<dyn ckpt_core::Format>) -> ckpt_core::Result<()> {
//! use ckpt_core::{Checkpointer, State, Tensor, Value};
//! let cp = Checkpointer::builder("memory://doc").format(format).build().await?;
//! let state = State::new()
//!     .with_tensor(Tensor::from_f32("w", vec![2], &[1.0, 2.0])?)
//!     .with_meta(Value::map([("epoch", Value::Int(3))]));
//! cp.save(10, &state).await?.wait().await?;
//! let loaded = cp.load_latest().await?.expect("one checkpoint");
//! assert_eq!(loaded.state, state);
//! # Ok(()) }
//! ```
#![warn(missing_docs)]

pub mod budget;
pub(crate) mod checkpointer;
pub mod coord;
mod error;
pub mod failpoint;
pub mod format;
pub mod layout;
pub(crate) mod load;
pub(crate) mod model;
pub(crate) mod save;
pub mod staging;
pub mod store;
pub mod sync;
#[cfg(feature = "testing")]
pub mod testing;
pub mod tiered;
#[cfg(feature = "torch")]
pub mod torch;

pub use checkpointer::{Checkpointer, CheckpointerBuilder, CheckpointerOptions, SnapshotMode};
pub use coord::{Coordinator, Solo};
pub use error::{verdict, Error, Result, Verdict};
pub use format::{
    Compression, Format, FormatRegistry, ReadContext, WriteContext, WriteOptions, WriteOutput,
};
pub use layout::{ChunkRef, GcReport, Layout, Manifest, Retention, TensorRecord};
pub use load::{BoxTarget, CheckpointInfo, Loaded, Status};
pub use model::{numel, CheckpointId, DType, Key, ShardSpec, State, Tensor, Value};
pub use save::{
    Capture, CopySource, LaterSnapshot, Ready, SaveHandle, SaveReport, SharedSnapshot, SharedVec,
    Slab, SourceTensor, TensorData,
};
pub use staging::BusyPolicy;
pub use tiered::{FlushReport, TieredCheckpointStore, TieredOptions};

/// Largest chunk (raw bytes) a chunked format writes or a decoder accepts.
pub const MAX_CHUNK_BYTES: usize = 1 << 30;

/// Whether this build of ckpt-core links libtorch (feature `torch`): a program
/// built with it needs libtorch on its library path to start.
pub const LINKS_LIBTORCH: bool = cfg!(feature = "torch");
