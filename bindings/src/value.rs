//! Plain Python data to [`ckpt_core::Value`] and back, exactly.
//!
//! `None`, `bool`, `int` (64-bit), `float` (bit for bit), `str`, `bytes`,
//! `list`, `tuple` and `dict` (with `str` or `int` keys) map one to one, so a
//! value comes back with the same types it went in with. A [`TensorRef`] marks
//! the place of a tensor. Anything else is refused: nothing is pickled.

use ckpt_core::{Key, Value};
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyBytes, PyDict, PyFloat, PyInt, PyList, PyString, PyTuple};

use crate::errors::invalid;

/// Deepest nesting accepted (protects the stack from cyclic or absurd input).
const MAX_DEPTH: usize = 256;

/// The place of a tensor inside a state tree, by name.
#[pyclass(frozen, eq, hash, module = "ckpt._ckpt")]
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct TensorRef {
    /// The tensor's name in the checkpoint.
    #[pyo3(get)]
    pub name: String,
}

#[pymethods]
impl TensorRef {
    #[new]
    fn new(name: String) -> Self {
        TensorRef { name }
    }

    fn __repr__(&self) -> String {
        format!("TensorRef({:?})", self.name)
    }
}

/// Convert a Python object tree into a [`Value`].
pub fn to_value(obj: &Bound<'_, PyAny>) -> PyResult<Value> {
    convert(obj, 0).map_err(|f| match f {
        Fail::Py(e) => e,
        Fail::At { rev_path, msg } => {
            let mut path = String::from("$");
            for seg in rev_path.iter().rev() {
                path.push_str(seg);
            }
            invalid(format!("{path}: {msg}"))
        }
    })
}

/// Why a conversion failed. The path of the refused value is made only then,
/// a segment per level on the way out (a save converts thousands of nodes,
/// and formatting each one's path cost more than converting it).
enum Fail {
    /// An error of Python's own (an extraction).
    Py(PyErr),
    /// A refused value: its path from the innermost segment out, and why.
    At { rev_path: Vec<String>, msg: String },
}

impl From<PyErr> for Fail {
    fn from(e: PyErr) -> Self {
        Fail::Py(e)
    }
}

fn refuse(msg: String) -> Fail {
    Fail::At {
        rev_path: Vec::new(),
        msg,
    }
}

/// `r` with `seg` (made only on failure) as the next outer segment of its path.
fn within(r: Result<Value, Fail>, seg: impl FnOnce() -> String) -> Result<Value, Fail> {
    r.map_err(|f| match f {
        Fail::At { mut rev_path, msg } => {
            rev_path.push(seg());
            Fail::At { rev_path, msg }
        }
        other => other,
    })
}

fn convert(obj: &Bound<'_, PyAny>, depth: usize) -> Result<Value, Fail> {
    if depth > MAX_DEPTH {
        return Err(refuse(format!(
            "nested deeper than {MAX_DEPTH} levels (a cycle?)"
        )));
    }
    if obj.is_none() {
        return Ok(Value::Null);
    }
    if let Ok(r) = obj.cast::<TensorRef>() {
        return Ok(Value::Tensor(r.get().name.clone()));
    }
    if obj.is_exact_instance_of::<PyString>() {
        return Ok(Value::Str(obj.extract()?));
    }
    if obj.is_exact_instance_of::<PyBool>() {
        return Ok(Value::Bool(obj.extract()?));
    }
    if obj.is_exact_instance_of::<PyInt>() {
        return obj
            .extract::<i64>()
            .map(Value::Int)
            .map_err(|_| refuse(format!("integer {obj} does not fit in 64 bits")));
    }
    if obj.is_exact_instance_of::<PyFloat>() {
        return Ok(Value::Float(obj.extract()?));
    }
    if obj.is_exact_instance_of::<PyBytes>() {
        return Ok(Value::Bytes(obj.extract()?));
    }
    if obj.is_exact_instance_of::<PyList>() || obj.is_exact_instance_of::<PyTuple>() {
        let mut items = Vec::new();
        for (i, item) in obj.try_iter()?.enumerate() {
            items.push(within(convert(&item?, depth + 1), || format!("[{i}]"))?);
        }
        return Ok(if obj.is_exact_instance_of::<PyList>() {
            Value::List(items)
        } else {
            Value::Tuple(items)
        });
    }
    if obj.is_exact_instance_of::<PyDict>() {
        let dict = obj.cast::<PyDict>().map_err(PyErr::from)?;
        let mut entries = Vec::with_capacity(dict.len());
        for (k, v) in dict.iter() {
            let key = if k.is_exact_instance_of::<PyString>() {
                Key::Str(k.extract()?)
            } else if k.is_exact_instance_of::<PyInt>() {
                Key::Int(
                    k.extract()
                        .map_err(|_| refuse(format!("key {k} does not fit in 64 bits")))?,
                )
            } else {
                let ty = k.get_type().name()?;
                return Err(refuse(format!("dict keys must be str or int, not {ty}")));
            };
            let value = within(convert(&v, depth + 1), || match k.repr() {
                Ok(r) => format!("[{r}]"),
                Err(_) => "[?]".into(),
            })?;
            entries.push((key, value));
        }
        return Ok(Value::Map(entries));
    }
    let ty = obj.get_type().name()?;
    Err(refuse(format!(
        "cannot store a value of type {ty} (plain data only: None, bool, int, float, str, bytes, list, tuple, dict)"
    )))
}

/// Convert a [`Value`] back into Python objects (tensors become [`TensorRef`]s).
pub fn from_value(py: Python<'_>, value: &Value) -> PyResult<Py<PyAny>> {
    Ok(match value {
        Value::Null => py.None(),
        Value::Bool(b) => PyBool::new(py, *b).to_owned().into_any().unbind(),
        Value::Int(i) => i.into_pyobject(py)?.into_any().unbind(),
        Value::Float(f) => PyFloat::new(py, *f).into_any().unbind(),
        Value::Str(s) => PyString::new(py, s).into_any().unbind(),
        Value::Bytes(b) => PyBytes::new(py, b).into_any().unbind(),
        Value::List(items) => {
            let items = items
                .iter()
                .map(|v| from_value(py, v))
                .collect::<PyResult<Vec<_>>>()?;
            PyList::new(py, items)?.into_any().unbind()
        }
        Value::Tuple(items) => {
            let items = items
                .iter()
                .map(|v| from_value(py, v))
                .collect::<PyResult<Vec<_>>>()?;
            PyTuple::new(py, items)?.into_any().unbind()
        }
        Value::Map(entries) => {
            let dict = PyDict::new(py);
            for (k, v) in entries {
                let v = from_value(py, v)?;
                match k {
                    Key::Int(i) => dict.set_item(i, v)?,
                    Key::Str(s) => dict.set_item(s, v)?,
                }
            }
            dict.into_any().unbind()
        }
        Value::Tensor(name) => Py::new(py, TensorRef { name: name.clone() })?.into_any(),
    })
}
