//! The schema of the metadata the Python package writes, for the package:
//! `ckpt_core::layout::pymeta` defines it (keys, version, tags, own-state names);
//! these functions build and read it without converting the state tree, which
//! passes through as the Python object it is.

use ckpt_core::layout::pymeta::{self, Bookkeeping, OwnState};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};

use crate::errors::to_py;
use crate::value::{from_value, to_value};

fn unsupported() -> PyErr {
    to_py(ckpt_core::Error::Unsupported(
        "this checkpoint was not written by the ckpt Python package".into(),
    ))
}

/// A checkpoint's metadata: ckpt's bookkeeping (the tensors saved from numpy,
/// how many ranks saved their own state, the memory-tier writer's
/// `(rank, ranks)`) and `state`, the flattened state tree as it is. Without
/// `state`, the bookkeeping alone (a save that reuses another's tree).
#[pyfunction]
#[pyo3(signature = (state, numpy, ranks = None, memory = None))]
pub fn meta<'py>(
    py: Python<'py>,
    state: Option<Bound<'py, PyAny>>,
    numpy: Vec<String>,
    ranks: Option<u64>,
    memory: Option<(u64, u64)>,
) -> PyResult<Bound<'py, PyDict>> {
    let info = Bookkeeping {
        numpy,
        ranks,
        memory,
    };
    let out = PyDict::new(py);
    out.set_item(pymeta::INFO_KEY, from_value(py, &info.to_value())?)?;
    if let Some(state) = state {
        out.set_item(pymeta::STATE_KEY, state)?;
    }
    Ok(out)
}

/// The parts of metadata the Python package wrote: `(state, numpy, ranks)`
/// (`ranks`: how many ranks saved their own state, or None).
/// `UnsupportedError` for any other metadata or another schema version.
#[pyfunction]
pub fn read_meta<'py>(
    meta: &Bound<'py, PyAny>,
) -> PyResult<(Bound<'py, PyDict>, Vec<String>, Option<u64>)> {
    let meta = meta.cast::<PyDict>().map_err(|_| unsupported())?;
    let (Some(info), Some(state)) = (
        meta.get_item(pymeta::INFO_KEY)?,
        meta.get_item(pymeta::STATE_KEY)?,
    ) else {
        return Err(unsupported());
    };
    let state = state.cast_into::<PyDict>().map_err(|_| unsupported())?;
    if !info.is_instance_of::<PyDict>() {
        return Err(unsupported());
    }
    let info = Bookkeeping::from_value(&to_value(&info)?).map_err(to_py)?;
    Ok((state, info.numpy, info.ranks))
}

/// The name of the tensor that holds rank `rank`'s own state (the prefix of
/// the tensors in it).
#[pyfunction]
pub fn own_name(rank: u64) -> String {
    pymeta::own_name(rank)
}

/// The rank whose own state tensor `name` belongs to, or None for a user's tensor.
#[pyfunction]
pub fn own_rank(name: &str) -> Option<u64> {
    pymeta::own_rank(name)
}

/// The bytes of the tensor that holds rank state: its `tree` (plain data with
/// `TensorRef` leaves) and the names of its tensors saved from numpy.
#[pyfunction]
pub fn encode_own<'py>(
    py: Python<'py>,
    tree: &Bound<'py, PyAny>,
    numpy: Vec<String>,
) -> PyResult<Bound<'py, PyBytes>> {
    let own = OwnState {
        tree: to_value(tree)?,
        numpy,
    };
    let bytes = serde_json::to_vec(&own.to_value())
        .map_err(|e| to_py(ckpt_core::Error::Internal(e.to_string())))?;
    Ok(PyBytes::new(py, &bytes))
}

/// `(tree, numpy)` of rank `rank`'s own state tensor made by [`encode_own`];
/// `UnsupportedError` when it holds something else.
#[pyfunction]
pub fn decode_own(py: Python<'_>, data: &[u8], rank: u64) -> PyResult<(Py<PyAny>, Vec<String>)> {
    let v: ckpt_core::Value = serde_json::from_slice(data).map_err(|_| {
        to_py(ckpt_core::Error::Unsupported(format!(
            "tensor {:?} does not hold a rank's own state",
            pymeta::own_name(rank)
        )))
    })?;
    let own = OwnState::from_value(&v, rank).map_err(to_py)?;
    Ok((from_value(py, &own.tree)?, own.numpy))
}

/// Adds the functions and the schema's constants to the module.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(meta, m)?)?;
    m.add_function(wrap_pyfunction!(read_meta, m)?)?;
    m.add_function(wrap_pyfunction!(own_name, m)?)?;
    m.add_function(wrap_pyfunction!(own_rank, m)?)?;
    m.add_function(wrap_pyfunction!(encode_own, m)?)?;
    m.add_function(wrap_pyfunction!(decode_own, m)?)?;
    m.add("META_VERSION", pymeta::META_VERSION)?;
    m.add("TYPE_TAG", pymeta::TYPE_TAG)?;
    m.add("ODICT_TAG", pymeta::ODICT_TAG)?;
    m.add("NP_SCALAR_TAG", pymeta::NP_SCALAR_TAG)?;
    Ok(())
}
