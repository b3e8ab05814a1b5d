//! The typed objects that cross the boundary instead of positional tuples.
//!
//! The Python glue builds a [`TensorSpec`] for each tensor of a save and a
//! [`LoadTarget`] for each destination of a load, with keyword arguments; a
//! [`Shard`] places a piece in its global tensor. All three are frozen and
//! check their dtype and shapes when they are made, so a bad entry fails in
//! the glue's own frame, not deep inside `save`. A [`SnapshotBytes`] is a
//! spec's bytes taken from another save's snapshot.

use ckpt_core::{DType, ShardSpec};
use pyo3::prelude::*;

use crate::errors::{invalid, IntoPyResult};

/// Where a piece sits in its global tensor: the global shape, and the offset
/// of the piece's first element along each dimension.
#[pyclass(frozen, get_all, module = "ckpt._ckpt")]
#[derive(Debug, Clone)]
pub struct Shard {
    /// Shape of the whole (global) tensor.
    pub global_shape: Vec<u64>,
    /// Offset of the piece along each dimension of the global tensor.
    pub offsets: Vec<u64>,
}

impl Shard {
    /// The engine's form of it.
    pub fn spec(&self) -> ShardSpec {
        ShardSpec {
            global_shape: self.global_shape.clone(),
            offsets: self.offsets.clone(),
        }
    }
}

impl From<ShardSpec> for Shard {
    fn from(s: ShardSpec) -> Self {
        Shard {
            global_shape: s.global_shape,
            offsets: s.offsets,
        }
    }
}

#[pymethods]
impl Shard {
    #[new]
    fn new(global_shape: Vec<u64>, offsets: Vec<u64>) -> PyResult<Self> {
        if global_shape.len() != offsets.len() {
            return Err(invalid(format!(
                "a shard's offsets ({offsets:?}) must have one entry per dimension of its global shape {global_shape:?}"
            )));
        }
        Ok(Shard {
            global_shape,
            offsets,
        })
    }

    fn __repr__(&self) -> String {
        format!(
            "Shard(global_shape={:?}, offsets={:?})",
            self.global_shape, self.offsets
        )
    }
}

fn parse_dtype(dtype: &str) -> PyResult<DType> {
    dtype.parse().py()
}

fn check_piece(name: &str, shape: &[u64], shard: Option<&Bound<'_, Shard>>) -> PyResult<()> {
    match shard {
        Some(s) if s.get().global_shape.len() != shape.len() => Err(invalid(format!(
            "tensor `{name}`: a piece of shape {shape:?} of a global tensor of shape {:?}",
            s.get().global_shape
        ))),
        _ => Ok(()),
    }
}

/// One tensor handed to `Checkpointer.save`.
///
/// `data` is any C-contiguous buffer of exactly the tensor's bytes, or a
/// `SlabSlot`. With `copy_now`, it is copied before `save` returns even in
/// lazy mode. `shard` places a piece of a sharded tensor (`None`: the whole
/// tensor, of shape `shape`).
#[pyclass(frozen, module = "ckpt._ckpt")]
pub struct TensorSpec {
    /// The tensor's name in the checkpoint.
    #[pyo3(get)]
    pub(crate) name: String,
    pub(crate) dtype: DType,
    /// Its shape (the piece's, for a piece of a sharded tensor).
    #[pyo3(get)]
    pub(crate) shape: Vec<u64>,
    /// Its bytes: a buffer, or a `SlabSlot`.
    #[pyo3(get)]
    pub(crate) data: Py<PyAny>,
    /// Whether `save` copies it before returning, even in lazy mode.
    #[pyo3(get)]
    pub(crate) copy_now: bool,
    /// Where the piece sits in the global tensor, or `None`.
    #[pyo3(get)]
    pub(crate) shard: Option<Py<Shard>>,
}

/// Bytes of another save's snapshot, handed to `save` as a tensor's bytes
/// (no copy; see `SaveHandle.snapshot_specs`).
#[pyclass(frozen, module = "ckpt._ckpt")]
pub struct SnapshotBytes {
    pub(crate) bytes: bytes::Bytes,
}

#[pymethods]
impl SnapshotBytes {
    fn __len__(&self) -> usize {
        self.bytes.len()
    }
}

impl TensorSpec {
    /// A tensor of another save's snapshot (see `SaveHandle.snapshot_specs`).
    pub(crate) fn shared(
        py: Python<'_>,
        name: String,
        dtype: DType,
        shape: Vec<u64>,
        shard: Option<ShardSpec>,
        bytes: bytes::Bytes,
    ) -> PyResult<Self> {
        let shard = shard.map(|s| Py::new(py, Shard::from(s))).transpose()?;
        Ok(TensorSpec {
            name,
            dtype,
            shape,
            data: Py::new(py, SnapshotBytes { bytes })?.into_any(),
            copy_now: false,
            shard,
        })
    }
}

#[pymethods]
impl TensorSpec {
    #[new]
    #[pyo3(signature = (*, name, dtype, shape, data, copy_now=false, shard=None))]
    fn new(
        name: String,
        dtype: &str,
        shape: Vec<u64>,
        data: Py<PyAny>,
        copy_now: bool,
        shard: Option<Bound<'_, Shard>>,
    ) -> PyResult<Self> {
        check_piece(&name, &shape, shard.as_ref())?;
        Ok(TensorSpec {
            dtype: parse_dtype(dtype)?,
            name,
            shape,
            data,
            copy_now,
            shard: shard.map(Bound::unbind),
        })
    }

    /// Its dtype (safetensors name, e.g. `"F32"`).
    #[getter]
    fn dtype(&self) -> &'static str {
        self.dtype.name()
    }

    /// The same tensor with other bytes or another `copy_now`.
    #[pyo3(signature = (*, data=None, copy_now=None))]
    fn replace(&self, py: Python<'_>, data: Option<Py<PyAny>>, copy_now: Option<bool>) -> Self {
        TensorSpec {
            name: self.name.clone(),
            dtype: self.dtype,
            shape: self.shape.clone(),
            data: data.unwrap_or_else(|| self.data.clone_ref(py)),
            copy_now: copy_now.unwrap_or(self.copy_now),
            shard: self.shard.as_ref().map(|s| s.clone_ref(py)),
        }
    }

    fn __repr__(&self, py: Python<'_>) -> String {
        let shard = match &self.shard {
            Some(s) => s.get().__repr__(),
            None => "None".into(),
        };
        let data = self
            .data
            .bind(py)
            .get_type()
            .name()
            .map_or_else(|_| "?".into(), |n| n.to_string());
        format!(
            "TensorSpec(name={:?}, dtype={:?}, shape={:?}, data=<{data}>, copy_now={}, shard={shard})",
            self.name,
            self.dtype.name(),
            self.shape,
            if self.copy_now { "True" } else { "False" },
        )
    }
}

/// One destination of `Checkpointer.load_into`: the box of extent `shape` of
/// tensor `name`, placed by `shard` in the global tensor (`None`: the whole
/// tensor, of shape `shape`), written into `dest`, a writable C-contiguous
/// buffer of exactly its bytes.
#[pyclass(frozen, module = "ckpt._ckpt")]
pub struct LoadTarget {
    /// The tensor's name in the checkpoint.
    #[pyo3(get)]
    pub(crate) name: String,
    pub(crate) dtype: DType,
    /// The box's shape.
    #[pyo3(get)]
    pub(crate) shape: Vec<u64>,
    /// The writable buffer the box is read into.
    #[pyo3(get)]
    pub(crate) dest: Py<PyAny>,
    /// Where the box sits in the global tensor, or `None`.
    #[pyo3(get)]
    pub(crate) shard: Option<Py<Shard>>,
}

impl LoadTarget {
    /// The box in the engine's form: the given shard, or the whole tensor.
    pub fn spec(&self) -> ShardSpec {
        match &self.shard {
            Some(s) => s.get().spec(),
            None => ShardSpec {
                offsets: vec![0; self.shape.len()],
                global_shape: self.shape.clone(),
            },
        }
    }
}

#[pymethods]
impl LoadTarget {
    #[new]
    #[pyo3(signature = (*, name, dtype, shape, dest, shard=None))]
    fn new(
        name: String,
        dtype: &str,
        shape: Vec<u64>,
        dest: Py<PyAny>,
        shard: Option<Bound<'_, Shard>>,
    ) -> PyResult<Self> {
        check_piece(&name, &shape, shard.as_ref())?;
        Ok(LoadTarget {
            dtype: parse_dtype(dtype)?,
            name,
            shape,
            dest,
            shard: shard.map(Bound::unbind),
        })
    }

    /// The dtype expected in the checkpoint.
    #[getter]
    fn dtype(&self) -> &'static str {
        self.dtype.name()
    }

    fn __repr__(&self) -> String {
        format!(
            "LoadTarget(name={:?}, dtype={:?}, shape={:?})",
            self.name,
            self.dtype.name(),
            self.shape
        )
    }
}
