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
pub mod catalog;
pub mod checkpointer;
pub mod chunks;
pub mod conformance;
pub mod coord;
pub mod dtype;
pub mod error;
pub mod failpoint;
pub mod format;
pub mod load;
pub mod manifest;
#[cfg(feature = "mpi")]
pub mod mpi;
pub mod paths;
mod persist;
pub mod pieces;
pub mod plan;
pub mod reshard;
pub mod retention;
pub mod save;
pub mod snapshot;
pub mod staging;
pub mod state;
pub mod store;
pub mod tensor;
#[cfg(feature = "torch")]
pub mod torch;
pub mod value;
mod wire;

pub use checkpointer::{Checkpointer, CheckpointerBuilder, CheckpointerOptions, SnapshotMode};
pub use coord::{Coordinator, Solo};
pub use dtype::DType;
pub use error::{CheckpointId, Error, Result};
pub use format::{
    Compression, Format, FormatRegistry, ReadContext, WriteContext, WriteOptions, WriteOutput,
};
pub use load::{CheckpointInfo, Loaded, Status};
pub use manifest::{ChunkRef, Layout, Manifest, TensorRecord};
pub use retention::{GcReport, Retention};
pub use save::{SaveHandle, SaveReport};
pub use snapshot::{Capture, CopySource, SharedVec, SourceTensor, TensorData};
pub use staging::{BusyPolicy, StagingPool};
pub use state::State;
pub use tensor::{ShardSpec, Tensor};
pub use value::{Key, Value};

/// Largest chunk (raw bytes) a chunked format writes or a decoder accepts.
pub const MAX_CHUNK_BYTES: usize = 1 << 30;

/// Whether this build of ckpt-core links libtorch (feature `torch`): a program
/// built with it needs libtorch on its library path to start.
pub const LINKS_LIBTORCH: bool = cfg!(feature = "torch");
