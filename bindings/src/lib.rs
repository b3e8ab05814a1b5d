//! `ckpt._ckpt`: the native part of the `ckpt` Python package.
//!
//! A thin layer over `ckpt-core`: tensors cross as CPU buffers (buffer
//! protocol), non-tensor state as plain data, errors as typed exceptions. The
//! framework glue (PyTorch, numpy, state-dict flattening, hooks, pinned
//! buffers) is plain Python in `python/ckpt/`. The wheel does not link libtorch.

pub mod args;
pub mod buffer;
pub mod checkpointer;
pub mod coord;
pub mod dest;
pub mod errors;
pub mod export;
pub mod handle;
pub mod host;
pub mod memroot;
pub mod results;
pub mod runtime;
pub mod schema;
pub mod slab;
pub mod value;
pub mod wire;

use pyo3::prelude::*;

/// The extension's Rust allocations (staging buffers, chunks read during a
/// load) come from mimalloc, not glibc malloc: glibc raises its mmap threshold
/// after the first multi-MiB buffer is freed, so later load buffers land in its
/// arenas and stay in the training process after every restore (measured: 46 to
/// 123 MiB kept per rank after each load of a 96 MiB FSDP2 shard, growing with
/// each load; with mimalloc it is given back). PyTorch's own allocations are
/// not affected. Freed memory goes back at once (see [`purge_at_once`]).
///
/// mimalloc is built without its transparent-huge-page advice (`no_thp`): with
/// it, mimalloc marks its arena `MADV_HUGEPAGE`, so the engine's small
/// allocations (records, messages, tasks) were spread over 2 MiB pages and a
/// rank of a 4-rank FSDP2 job kept about 25 MiB resident for them (measured:
/// 6 MiB without). The staging buffers ask for huge pages themselves, and
/// mimalloc's other choice, `allow_thp = 0`, would turn huge pages off for the
/// whole process, PyTorch's tensors included.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// mimalloc's `mi_option_purge_delay` (the same place in its option enum in
/// mimalloc 2 and 3; libmimalloc-sys names only the stable options).
const MI_OPTION_PURGE_DELAY: libmimalloc_sys::mi_option_t = 15;

/// What sets the purge delay by hand (it then stays as the user set it).
const PURGE_DELAY_ENV: &str = "MIMALLOC_PURGE_DELAY";

/// Make mimalloc return freed memory to the OS at once instead of after its
/// purge delay, which only runs out when the freeing thread allocates again:
/// the engine's threads sit idle after a load, so its read buffers would
/// otherwise stay resident in the training process. Set through mimalloc's
/// API when the module loads (it reads the option at every purge), so the
/// process environment, which child processes inherit, is left alone. A
/// `MIMALLOC_PURGE_DELAY` the user set wins: mimalloc read it at start.
fn purge_at_once() {
    if std::env::var_os(PURGE_DELAY_ENV).is_none() {
        // SAFETY: sets one of mimalloc's options (an atomic store).
        unsafe { libmimalloc_sys::mi_option_set(MI_OPTION_PURGE_DELAY, 0) }
    }
}

/// mimalloc's purge delay in milliseconds, as the extension's allocator uses it.
#[pyfunction]
fn _mimalloc_purge_delay() -> std::os::raw::c_long {
    // SAFETY: reads one of mimalloc's options.
    unsafe { libmimalloc_sys::mi_option_get(MI_OPTION_PURGE_DELAY) }
}

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

/// Encode a plain-data tree (the types `save` accepts as metadata, with
/// `TensorRef` leaves) as bytes, exactly as a manifest stores it. The Python
/// package stores each rank's own state (its RNG) this way, inside a tensor,
/// because only rank 0's metadata reaches the manifest.
#[pyfunction]
fn encode_tree<'py>(
    py: Python<'py>,
    tree: &Bound<'py, PyAny>,
) -> PyResult<Bound<'py, pyo3::types::PyBytes>> {
    let v = value::to_value(tree)?;
    let bytes = serde_json::to_vec(&v)
        .map_err(|e| errors::to_py(ckpt_core::Error::Internal(e.to_string())))?;
    Ok(pyo3::types::PyBytes::new(py, &bytes))
}

/// Decode bytes made by [`encode_tree`].
#[pyfunction]
fn decode_tree(py: Python<'_>, data: &[u8]) -> PyResult<Py<PyAny>> {
    let v: ckpt_core::Value = serde_json::from_slice(data)
        .map_err(|e| errors::invalid(format!("not an encoded tree: {e}")))?;
    value::from_value(py, &v)
}

/// The manifest of one checkpoint made of the manifests (stored form, in rank
/// order) that several ranks committed alone for the same step (see
/// `ckpt_core::layout::merge`). Every part is verified as a load would; the
/// memory tier loads such a checkpoint into a job of another shape.
#[pyfunction]
fn merge_manifests<'py>(
    py: Python<'py>,
    parts: Vec<Vec<u8>>,
) -> PyResult<Bound<'py, pyo3::types::PyBytes>> {
    let decoded = parts
        .iter()
        .enumerate()
        .map(|(r, b)| ckpt_core::layout::Manifest::decode(b, &format!("rank {r}'s manifest")))
        .collect::<ckpt_core::Result<Vec<_>>>()
        .map_err(errors::to_py)?;
    let merged = ckpt_core::layout::merge::merge_ranks(&decoded)
        .and_then(|m| m.encode())
        .map_err(errors::to_py)?;
    Ok(pyo3::types::PyBytes::new(py, &merged))
}

/// Set how many CPU-heavy jobs of checkpointing (hashing, compression,
/// verification) may run at once in this process; returns the previous value.
#[pyfunction]
fn set_cpu_threads(n: usize) -> usize {
    let before = ckpt_core::budget::cpu_threads();
    ckpt_core::budget::set_cpu_threads(n);
    before
}

/// The number of CPU-heavy jobs of checkpointing that may run at once.
#[pyfunction]
fn cpu_threads() -> usize {
    ckpt_core::budget::cpu_threads()
}

/// The native module.
#[pymodule]
fn _ckpt(m: &Bound<'_, PyModule>) -> PyResult<()> {
    purge_at_once();
    m.add_class::<checkpointer::Checkpointer>()?;
    m.add_class::<args::TensorSpec>()?;
    m.add_class::<args::LoadTarget>()?;
    m.add_class::<args::Shard>()?;
    m.add_class::<results::TensorInfo>()?;
    m.add_class::<results::GcReport>()?;
    m.add_class::<handle::SaveHandle>()?;
    m.add_class::<args::SnapshotBytes>()?;
    m.add_class::<buffer::TensorBuffer>()?;
    m.add_class::<value::TensorRef>()?;
    m.add_class::<slab::HostSlab>()?;
    m.add_class::<slab::SlabSlot>()?;
    m.add_class::<host::HostRun>()?;
    m.add_class::<host::HostSpan>()?;
    m.add_class::<memroot::MemoryRoot>()?;
    m.add_function(wrap_pyfunction!(_after_fork_child, m)?)?;
    m.add_function(wrap_pyfunction!(_mimalloc_purge_delay, m)?)?;
    m.add_function(wrap_pyfunction!(dtypes, m)?)?;
    m.add_function(wrap_pyfunction!(set_cpu_threads, m)?)?;
    m.add_function(wrap_pyfunction!(cpu_threads, m)?)?;
    m.add_function(wrap_pyfunction!(encode_tree, m)?)?;
    m.add_function(wrap_pyfunction!(decode_tree, m)?)?;
    m.add_function(wrap_pyfunction!(merge_manifests, m)?)?;
    schema::register(m)?;
    m.add_function(wrap_pyfunction!(wire::error_to_wire, m)?)?;
    m.add_function(wrap_pyfunction!(wire::error_from_wire, m)?)?;
    m.add_function(wrap_pyfunction!(wire::is_damage, m)?)?;
    m.add_function(wrap_pyfunction!(wire::verdict, m)?)?;
    m.add_function(wrap_pyfunction!(export::export, m)?)?;
    m.add_function(wrap_pyfunction!(export::cli_main, m)?)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    // Where a large staging buffer's or slab slot's data starts within its
    // page: the native chunk header's length.
    m.add("STAGING_LEAD", ckpt_core::staging::STAGING_LEAD)?;
    Ok(())
}
