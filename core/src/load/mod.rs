//! Loading: whole checkpoints, the newest good one, single tensors, sharded
//! tensors into any split, and listing and verifying.
//!
//! - [`read`]: `Checkpointer::load`, `load_latest`, `load_tensor`, `list`,
//!   `verify` ([`Loaded`], [`CheckpointInfo`], [`Status`]).
//! - [`shards`]: sharded tensors, whole or resharded (`load_shards`,
//!   `load_boxes_into`, [`BoxTarget`]).
//! - [`reshard`]: the geometry: the overlap of two boxes of one global tensor (pure).
//!
//! Dependencies run one way: `shards` → `read`, `shards` → `reshard`.

pub(crate) mod read;
pub(crate) mod reshard;
pub(crate) mod select;
pub(crate) mod shards;

pub use read::{CheckpointInfo, Loaded, Status};
pub use shards::BoxTarget;
