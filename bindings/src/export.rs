//! `ckpt.export` and the `ckpt` console script: thin calls into
//! `ckpt_formats::export` and `ckpt_cli`, so Python and Rust behave the same.

use std::path::PathBuf;

use ckpt_formats::export::{self as formats_export, ExportOptions, HF_SHARD_BYTES};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::errors::to_py;
use crate::runtime;

/// Export the tensors of one entry of a checkpoint for inference (see
/// `ckpt.export`). Returns `{"step", "tensors", "bytes", "files"}`.
#[pyfunction]
#[pyo3(signature = (url, out, entry, format="safetensors", dtype=None, hf=false, step=None, max_shard_bytes=HF_SHARD_BYTES, config=None))]
#[allow(clippy::too_many_arguments)]
pub fn export<'py>(
    py: Python<'py>,
    url: String,
    out: PathBuf,
    entry: String,
    format: &str,
    dtype: Option<&str>,
    hf: bool,
    step: Option<u64>,
    max_shard_bytes: u64,
    config: Option<PathBuf>,
) -> PyResult<Bound<'py, PyDict>> {
    let opts = ExportOptions {
        entry,
        format: format.parse().map_err(to_py)?,
        dtype: dtype
            .map(formats_export::cast::parse_target)
            .transpose()
            .map_err(to_py)?,
        hf,
        step,
        max_shard_bytes,
        config,
    };
    let r = runtime::wait(py, || async move {
        formats_export::export(&url, &out, &opts).await
    })?
    .map_err(to_py)?;
    let d = PyDict::new(py);
    d.set_item("step", r.step)?;
    d.set_item("tensors", r.tensors)?;
    d.set_item("bytes", r.bytes)?;
    let files: Vec<String> = r.files.iter().map(|f| f.display().to_string()).collect();
    d.set_item("files", files)?;
    Ok(d)
}

/// Run the `ckpt` command with `argv` (program name first); returns its exit status.
#[pyfunction]
pub fn cli_main(py: Python<'_>, argv: Vec<String>) -> i32 {
    py.detach(move || ckpt_cli::main_with_args(argv))
}
