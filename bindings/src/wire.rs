//! Failures as they cross between ranks, for the Python package: a Python
//! exception to `ckpt_core::Error` and its wire form (the one the engine's own
//! saves use between ranks), back again, and the one damage predicate and
//! cross-rank verdict of `ckpt-core`. The package's collectives carry the
//! bytes; what they mean is decided here, once.

use ckpt_core::Error;
use pyo3::exceptions::PyOSError;
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use crate::errors::{
    to_py, CheckpointIOError, CheckpointTimeoutError, ConflictError, CorruptError, FencedError,
    InternalError, InvalidInputError, NotFoundError, SkippedError, StorageError, StragglerError,
    UnsupportedError,
};

/// The prefix `Error`'s `Display` puts before a message it wraps: stripped
/// from an exception's text before it is wrapped again.
fn bare<'a>(msg: &'a str, prefix: &str) -> &'a str {
    msg.strip_prefix(prefix).unwrap_or(msg)
}

fn attr<'py, T: FromPyObjectOwned<'py>>(exc: &Bound<'py, PyAny>, name: &str) -> Option<T> {
    exc.getattr(name).ok()?.extract().ok()
}

/// The `ckpt_core::Error` a Python exception stands for: a ckpt exception as
/// its variant (with its fields), anything else as [`Error::Internal`].
pub fn from_py(exc: &Bound<'_, PyAny>) -> Error {
    let msg = exc.str().map(|s| s.to_string()).unwrap_or_default();
    let errno = || attr::<i32>(exc, "errno");
    let strerror = || attr::<String>(exc, "strerror").unwrap_or_else(|| msg.clone());
    // Subclasses before the classes they derive from (all derive from CheckpointError).
    if exc.is_instance_of::<NotFoundError>() {
        Error::NotFound {
            what: bare(&msg, "not found: ").to_owned(),
        }
    } else if exc.is_instance_of::<CorruptError>() {
        let reason = attr::<String>(exc, "reason").filter(|r| !r.is_empty());
        Error::Corrupt {
            object: attr(exc, "object").unwrap_or_default(),
            tensor: attr::<Option<String>>(exc, "tensor").flatten(),
            reason: reason.unwrap_or_else(|| msg.clone()),
        }
    } else if exc.is_instance_of::<FencedError>() {
        Error::Fenced {
            epoch: attr(exc, "epoch").unwrap_or(0),
            current: attr(exc, "current").unwrap_or(0),
        }
    } else if exc.is_instance_of::<ConflictError>() {
        Error::Conflict(bare(&msg, "conflict: ").to_owned())
    } else if exc.is_instance_of::<InvalidInputError>() {
        Error::InvalidInput(bare(&msg, "invalid input: ").to_owned())
    } else if exc.is_instance_of::<UnsupportedError>() {
        Error::Unsupported(bare(&msg, "unsupported: ").to_owned())
    } else if exc.is_instance_of::<StorageError>() {
        Error::remote_storage(bare(&strerror(), "storage error: "), errno())
    } else if exc.is_instance_of::<CheckpointIOError>() {
        Error::remote_io(bare(&strerror(), "i/o error: "), errno())
    } else if exc.is_instance_of::<StragglerError>() {
        Error::Stragglers {
            what: attr(exc, "what").unwrap_or_else(|| msg.clone()),
            ranks: attr(exc, "ranks").unwrap_or_default(),
            world: attr(exc, "world_size").unwrap_or(0),
            timeout_ms: attr::<f64>(exc, "timeout").map_or(0, |s| (s * 1000.0).round() as u64),
        }
    } else if exc.is_instance_of::<CheckpointTimeoutError>() {
        Error::Timeout(bare(&msg, "timed out: ").to_owned())
    } else if exc.is_instance_of::<SkippedError>() {
        Error::Skipped {
            step: attr(exc, "step").unwrap_or(0),
            reason: msg,
        }
    } else if exc.is_instance_of::<InternalError>() {
        Error::Internal(bare(&msg, "internal error: ").to_owned())
    } else {
        let ty = exc
            .get_type()
            .name()
            .map(|n| n.to_string())
            .unwrap_or_default();
        let detail = if exc.is_instance_of::<PyOSError>() {
            strerror()
        } else {
            msg
        };
        Error::Internal(format!("{ty}: {detail}"))
    }
}

/// A failure's wire form: what a rank sends the others so that each rebuilds
/// the same exception class (with its fields and errno).
#[pyfunction]
pub fn error_to_wire<'py>(exc: &Bound<'py, PyAny>) -> Bound<'py, PyBytes> {
    PyBytes::new(exc.py(), &from_py(exc).to_wire())
}

/// The exception a wire form (from [`error_to_wire`], on any rank) stands for,
/// with `context` (e.g. `"rank 1: "`) in front of its message.
#[pyfunction]
#[pyo3(signature = (data, context = ""))]
pub fn error_from_wire(py: Python<'_>, data: &[u8], context: &str) -> PyResult<Py<PyAny>> {
    let e = Error::from_wire(data, context).map_err(to_py)?;
    Ok(to_py(e).into_value(py).into_any())
}

/// Whether a failure says that stored data is damaged or missing (a load
/// falls back past such a checkpoint), as opposed to every other failure.
/// The one predicate, `ckpt_core::Error::is_damage`.
#[pyfunction]
pub fn is_damage(exc: &Bound<'_, PyAny>) -> bool {
    from_py(exc).is_damage()
}

/// The verdict of a step every rank took, from every rank's outcome in rank
/// order (empty bytes: that rank succeeded; else its wire form): `None` when
/// all succeeded, else `(rank, damage)`: the rank whose failure every rank
/// reports, and whether every failure was damage (fall back together) or not
/// (raise on every rank). `ckpt_core::verdict`.
#[pyfunction]
pub fn verdict(outcomes: Vec<Vec<u8>>) -> PyResult<Option<(usize, bool)>> {
    let errors = outcomes
        .iter()
        .enumerate()
        .map(|(r, b)| {
            if b.is_empty() {
                Ok(None)
            } else {
                Error::from_wire(b, &format!("rank {r}: ")).map(Some)
            }
        })
        .collect::<ckpt_core::Result<Vec<_>>>()
        .map_err(to_py)?;
    Ok(ckpt_core::verdict(&errors).map(|v| (v.rank, v.damage)))
}
