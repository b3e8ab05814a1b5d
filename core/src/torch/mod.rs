//! The `tch` adapter (feature `torch`): checkpoint a Rust training loop on libtorch.
//!
//! - [`TorchCapture`] turns `tch::Tensor`s, whole [`tch::nn::VarStore`]s and plain
//!   data into a [`Capture`](crate::Capture) for [`Checkpointer::save`](crate::Checkpointer::save).
//!   CPU tensors are copied into the engine's staging buffers at snapshot time (in
//!   lazy mode after `save` returned: call `wait_snapshot()` before the optimizer
//!   step). CUDA tensors are copied into pinned host memory with non-blocking
//!   copies issued on the tensor's current stream when they are captured; the
//!   snapshot synchronises the device before it reads those buffers, and the persist
//!   phase never touches GPU memory.
//! - [`restore`] puts checkpointed tensors back: into live tensors (keeping their
//!   device and dtype), into a whole `VarStore`, or as new tensors on a device.
//! - [`Adam`] is an optimizer implemented here on tch tensors, because tch's own
//!   [`tch::nn::Optimizer`] keeps its moment buffers inside libtorch where they can
//!   be neither read nor written back; a loop that must resume bitwise identically
//!   uses this one (or keeps any other optimizer's state in tensors it owns).
//! - [`rng`]: tch reaches torch's generators only through `manual_seed`, so a
//!   resumable loop reseeds them from `(seed, step)` at the start of every step
//!   ([`rng::reseed`]); the checkpoint then only needs the seed and the step.
//!
//! ```no_run
//! # async fn demo(cp: ckpt_core::Checkpointer, vs: tch::nn::VarStore,
//! #               opt: ckpt_core::torch::Adam, step: u64) -> ckpt_core::Result<()> {
//! use ckpt_core::torch::TorchCapture;
//! use ckpt_core::Value;
//! let mut cap = TorchCapture::new();
//! cap.var_store("model/", &vs)?;
//! opt.capture("optim/", &mut cap)?;
//! cap.meta("step", Value::Int(step as i64));
//! let handle = cp.save(step, cap).await?;
//! handle.wait_snapshot().await?; // before the next optimizer step
//! # Ok(()) }
//! ```

mod capture;
mod cuda;
mod kind;
mod optim;
pub mod restore;
pub mod rng;

/// The `tch` crate this adapter is built against (use it to get matching types).
pub use tch;

pub use capture::{CpuTensorSource, TorchCapture};
pub use cuda::PinnedTensorSource;
pub use kind::{dtype_of, kind_of};
pub use optim::{Adam, AdamConfig};

use crate::error::Error;

/// Turn a libtorch error into a ckpt error, saying what was being done.
pub(crate) fn tch_err(what: &str, e: tch::TchError) -> Error {
    Error::Internal(format!("libtorch failed to {what}: {e}"))
}

#[cfg(test)]
mod tests;
