//! `ckpt._ckpt`: the native part of the `ckpt` Python package.
//!
//! A thin layer over `ckpt-core`: tensors cross as CPU buffers (buffer
//! protocol), non-tensor state as plain data, errors as typed exceptions. The
//! framework glue (PyTorch, numpy, state-dict flattening, hooks, pinned
//! buffers) is plain Python in `python/ckpt/`. The wheel does not link libtorch.

pub mod buffer;
pub mod checkpointer;
pub mod errors;
pub mod handle;
pub mod runtime;
pub mod value;

use pyo3::prelude::*;

/// Forget the tokio runtime inherited from the parent process (registered with
/// `os.register_at_fork(after_in_child=...)` by the Python package).
#[pyfunction]
fn _after_fork_child() {
    runtime::forget_after_fork();
}

/// The dtype names this build knows (safetensors names).
#[pyfunction]
fn dtypes() -> Vec<&'static str> {
    ckpt_core::DType::ALL.iter().map(|d| d.name()).collect()
}

/// The native module.
#[pymodule]
fn _ckpt(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<checkpointer::Checkpointer>()?;
    m.add_class::<handle::SaveHandle>()?;
    m.add_class::<buffer::TensorBuffer>()?;
    m.add_class::<value::TensorRef>()?;
    m.add_function(wrap_pyfunction!(_after_fork_child, m)?)?;
    m.add_function(wrap_pyfunction!(dtypes, m)?)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
