//! The data model: what a checkpoint holds ([`State`]: named [`Tensor`]s plus
//! plain-data [`Value`] metadata), element types ([`DType`]), and the identity of
//! a stored checkpoint ([`CheckpointId`]). Pure: no storage, no async.

pub(crate) mod dtype;
pub(crate) mod id;
pub(crate) mod state;
pub(crate) mod tensor;
pub(crate) mod value;

pub use dtype::DType;
pub use id::CheckpointId;
pub use state::State;
pub use tensor::{numel, ShardSpec, Tensor};
pub use value::{Key, Value};
