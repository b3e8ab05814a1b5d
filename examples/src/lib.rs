//! Runnable Rust training loops that checkpoint with ckpt, crash and resume.
//!
//! - `tch_train` (feature `torch`): an MLP on generated data trained with `tch`,
//!   checkpointing its `VarStore`, its optimizer state, and its position every `k`
//!   steps; killed at any instant and restarted, it ends with the same weights, bit
//!   for bit, as a run that was never interrupted (`tests/tch_resume.rs` checks it).
//!   Its loop (`tch_loop`) takes hooks; the fault campaign's victim in ckpt-faults
//!   is the same loop with its own. `torch_file` writes and reads the loop's
//!   state with libtorch's own serializer instead, the baseline of the campaign.
//! - `tch_gpu_bench` (feature `torch`): the stall of a GPU save against a plain
//!   device-to-host copy of the same tensors.
//!
//! Python examples live in `examples/python/`.
#![warn(missing_docs)]

#[cfg(feature = "torch")]
pub mod tch_loop;
#[cfg(feature = "torch")]
pub mod torch_file;
#[cfg(feature = "torch")]
pub mod weights;
