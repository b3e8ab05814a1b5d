//! Typed results the engine hands back to Python (instead of tuples and dicts):
//! a row of a checkpoint's tensor table, and what a garbage collection did.

use ckpt_core::{CheckpointId, GcReport as CoreGcReport};
use pyo3::prelude::*;

/// One tensor of a checkpoint's table, as `Checkpointer.contents` lists it:
/// dtype, global shape, how many stored pieces make it up, and its bytes.
#[pyclass(frozen, get_all, module = "ckpt._ckpt")]
#[derive(Debug, Clone)]
pub struct TensorInfo {
    /// dtype (safetensors name).
    pub dtype: String,
    /// Shape of the whole tensor.
    pub global_shape: Vec<u64>,
    /// Stored pieces (1 for a tensor saved whole).
    pub pieces: usize,
    /// Bytes of the whole tensor.
    pub nbytes: u64,
}

#[pymethods]
impl TensorInfo {
    fn __repr__(&self) -> String {
        format!(
            "TensorInfo(dtype={:?}, global_shape={:?}, pieces={}, nbytes={})",
            self.dtype, self.global_shape, self.pieces, self.nbytes
        )
    }
}

/// What `Checkpointer.gc` removed: checkpoints retired by the retention
/// policy and incomplete saves, as `(step, attempt)`, and unreferenced chunks.
#[pyclass(frozen, get_all, module = "ckpt._ckpt")]
#[derive(Debug, Clone, Default)]
pub struct GcReport {
    /// Checkpoints retired (manifest and data deleted), oldest first.
    pub retired: Vec<(u64, String)>,
    /// Incomplete saves whose data was deleted.
    pub incomplete_removed: Vec<(u64, String)>,
    /// Chunks deleted (data no kept checkpoint references).
    pub chunks_deleted: u64,
    /// True when the chunk sweep was skipped because a kept manifest was unreadable.
    pub chunk_sweep_skipped: bool,
}

fn ids(v: &[CheckpointId]) -> Vec<(u64, String)> {
    v.iter().map(|id| (id.step, id.attempt.clone())).collect()
}

/// `[(step, 'attempt'), ...]`, as Python writes the list (attempts are hex).
fn ids_repr(ids: &[(u64, String)]) -> String {
    let items: Vec<String> = ids.iter().map(|(s, a)| format!("({s}, '{a}')")).collect();
    format!("[{}]", items.join(", "))
}

impl From<&CoreGcReport> for GcReport {
    fn from(r: &CoreGcReport) -> Self {
        GcReport {
            retired: ids(&r.retired),
            incomplete_removed: ids(&r.incomplete_removed),
            chunks_deleted: r.chunks_deleted,
            chunk_sweep_skipped: r.chunk_sweep_skipped,
        }
    }
}

#[pymethods]
impl GcReport {
    /// An empty report (nothing removed).
    #[new]
    fn new() -> Self {
        GcReport::default()
    }

    fn __repr__(&self) -> String {
        format!(
            "GcReport(retired={}, incomplete_removed={}, chunks_deleted={}, chunk_sweep_skipped={})",
            ids_repr(&self.retired),
            ids_repr(&self.incomplete_removed),
            self.chunks_deleted,
            if self.chunk_sweep_skipped { "True" } else { "False" }
        )
    }
}
