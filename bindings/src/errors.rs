//! `ckpt_core::Error` to Python exceptions.
//!
//! The exception classes are plain Python (`ckpt/errors.py`), so they can also
//! derive from the matching built-in (`ValueError`, `OSError`, `TimeoutError`,
//! `LookupError`); here each error variant picks its class.

use ckpt_core::Error;
use pyo3::prelude::*;

pyo3::import_exception!(ckpt.errors, CheckpointError);
pyo3::import_exception!(ckpt.errors, NotFoundError);
pyo3::import_exception!(ckpt.errors, CorruptError);
pyo3::import_exception!(ckpt.errors, ConflictError);
pyo3::import_exception!(ckpt.errors, FencedError);
pyo3::import_exception!(ckpt.errors, InvalidInputError);
pyo3::import_exception!(ckpt.errors, UnsupportedError);
pyo3::import_exception!(ckpt.errors, StorageError);
pyo3::import_exception!(ckpt.errors, CheckpointIOError);
pyo3::import_exception!(ckpt.errors, CheckpointTimeoutError);
pyo3::import_exception!(ckpt.errors, StragglerError);
pyo3::import_exception!(ckpt.errors, SkippedError);
pyo3::import_exception!(ckpt.errors, InternalError);

/// Convert an error, keeping its kind (and, for corruption, the object and tensor).
pub fn to_py(err: Error) -> PyErr {
    to_py_ref(&err)
}

/// Convert an error that is shared (a save's result can be waited on twice).
pub fn to_py_ref(err: &Error) -> PyErr {
    let msg = err.to_string();
    match err {
        Error::NotFound { .. } => NotFoundError::new_err(msg),
        Error::Corrupt {
            object,
            tensor,
            reason,
        } => CorruptError::new_err((msg, object.clone(), tensor.clone(), reason.clone())),
        Error::Conflict(_) => ConflictError::new_err(msg),
        Error::Fenced { epoch, current } => FencedError::new_err((msg, *epoch, *current)),
        Error::InvalidInput(_) => InvalidInputError::new_err(msg),
        Error::Unsupported(_) => UnsupportedError::new_err(msg),
        // A stored object that is gone: the data is missing, not the store failing.
        Error::Storage(_) if err.is_damage() => NotFoundError::new_err(msg),
        // OSError's (errno, strerror) form: `e.errno` is the operating system's
        // error number (ENOSPC for a full disk), as for any OSError.
        Error::Storage(_) => match err.os_errno() {
            Some(n) => StorageError::new_err((n, msg)),
            None => StorageError::new_err(msg),
        },
        Error::Io(_) => match err.os_errno() {
            Some(n) => CheckpointIOError::new_err((n, msg)),
            None => CheckpointIOError::new_err(msg),
        },
        Error::Timeout(_) => CheckpointTimeoutError::new_err(msg),
        Error::Stragglers {
            what,
            ranks,
            world,
            timeout_ms,
        } => StragglerError::new_err((
            msg,
            ranks.clone(),
            *world,
            what.clone(),
            *timeout_ms as f64 / 1000.0,
        )),
        Error::Skipped { step, .. } => SkippedError::new_err((msg, *step)),
        Error::Internal(_) => InternalError::new_err(msg),
        _ => CheckpointError::new_err(msg),
    }
}

/// Shorthand for an invalid-input error raised from the binding itself.
pub fn invalid(msg: impl Into<String>) -> PyErr {
    to_py(Error::InvalidInput(msg.into()))
}

/// Extension to turn `ckpt_core::Result` into `PyResult`.
pub trait IntoPyResult<T> {
    /// Map the error with [`to_py`].
    fn py(self) -> PyResult<T>;
}

impl<T> IntoPyResult<T> for ckpt_core::Result<T> {
    fn py(self) -> PyResult<T> {
        self.map_err(to_py)
    }
}
