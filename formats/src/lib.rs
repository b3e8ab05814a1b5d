//! # ckpt-formats
//!
//! On-storage formats for ckpt, each behind the [`ckpt_core::Format`] trait:
//!
//! - [`native::Native`]: chunked, optionally zstd-compressed, blake3-verified,
//!   content-addressed (incremental checkpoints for free).
//!
//! [`builder`] opens a checkpointer with the native format and every reader
//! registered:
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> ckpt_core::Result<()> {
//! use ckpt_core::{State, Tensor};
//! let cp = ckpt_formats::builder("memory://formats-doc").build().await?;
//! let state = State::new().with_tensor(Tensor::from_f32("w", vec![3], &[1.0, 2.0, 3.0])?);
//! cp.save(1, &state).await?.wait().await?;
//! assert_eq!(cp.load_latest().await?.unwrap().state, state);
//! # Ok(()) }
//! ```
#![warn(missing_docs)]

pub mod convert;
pub mod error;
pub mod export;
#[cfg(feature = "hdf5")]
pub mod hdf5;
pub mod native;
pub mod pylayout;
pub mod safetensors;
pub mod torch;

use std::sync::Arc;

use ckpt_core::{CheckpointerBuilder, Format, FormatRegistry};

pub use error::CodecError;

/// The native format, ready to hand to a checkpointer.
pub fn native() -> Arc<dyn Format> {
    Arc::new(native::Native)
}

/// Every format this crate provides, for loading checkpoints written in any of them.
pub fn registry() -> FormatRegistry {
    let mut r = FormatRegistry::new();
    r.register(native());
    r.register(Arc::new(safetensors::Safetensors));
    r.register(Arc::new(torch::Torch));
    #[cfg(feature = "hdf5")]
    r.register(Arc::new(hdf5::Hdf5));
    r
}

/// Look a format up by name (`native`).
pub fn by_name(name: &str) -> ckpt_core::Result<Arc<dyn Format>> {
    #[cfg(not(feature = "hdf5"))]
    if name == "hdf5" {
        return Err(ckpt_core::Error::Unsupported(
            "HDF5 is not built into this ckpt: build it with the `hdf5` feature, which needs \
             libhdf5 (Debian: apt-get install libhdf5-dev; the Python wheel has it by default)"
                .into(),
        ));
    }
    registry().get(name)
}

/// A checkpointer builder for `url` that writes the native format and reads every format.
pub fn builder(url: impl Into<String>) -> CheckpointerBuilder {
    ckpt_core::Checkpointer::builder(url)
        .readers(registry())
        .format(native())
}
