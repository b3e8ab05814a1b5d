//! A [`Coordinator`] that delegates to a Python object.
//!
//! The object has `rank` and `world_size` (ints, or methods returning them) and
//! two methods:
//!
//! - `all_gather(data: bytes) -> list[bytes]`: every rank's `data`, in rank order;
//! - `broadcast(data: bytes, root: int) -> bytes`: `root`'s `data` on every rank;
//!
//! and, if it has one, `gather(data: bytes, root: int) -> list[bytes]`: every
//! rank's `data` on `root` (anything elsewhere), which a save uses so that no
//! rank but rank 0 receives more as the job grows (without it: `all_gather`).
//!
//! `ckpt.distributed` provides them over `torch.distributed` and mpi4py. The
//! engine calls them from its background tasks; a tokio worker must never wait
//! for the GIL (the training loop holds it most of the time, and a blocked worker
//! stalls every other task), so one dedicated thread per coordinator makes the
//! calls, with the GIL, one at a time and in the order the engine asked: the
//! `ckpt_core::coord::CollectiveThread` that MPI uses too. The async side waits
//! for the reply with the collective's deadline. A collective that missed its
//! deadline, or raised (a peer's connection closed), leaves the ranks out of
//! step: the coordinator is then marked broken, and every later call fails at
//! once with the same error kind.

use std::fmt;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use ckpt_core::coord::{BlockingCollectives, CollectiveThread, Coordinator};
use ckpt_core::sync::MutexExt;
use ckpt_core::{Error, Result};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList, PyTuple};

use crate::errors::invalid;

/// The Python object, shared with the coordination thread.
///
/// The thread only borrows it for each call: the object (a process group, a
/// communicator) is released where the checkpointer is, normally on the
/// training loop's thread. Tearing a gloo group down on the coordination thread
/// while the main thread destroys the process groups or exits aborts the process.
type Target = Arc<Mutex<Option<Py<PyAny>>>>;

/// A coordinator backed by a Python object (see the module docs).
pub struct PyCoordinator {
    rank: usize,
    size: usize,
    label: String,
    thread: CollectiveThread,
    target: Target,
}

impl Drop for PyCoordinator {
    fn drop(&mut self) {
        // With the GIL (a Python `del`), released now; without it, at the next
        // moment any thread holds the GIL.
        let t = self.target.lock_unpoisoned().take();
        drop(t);
    }
}

impl fmt::Debug for PyCoordinator {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PyCoordinator")
            .field("label", &self.label)
            .field("rank", &self.rank)
            .field("world_size", &self.size)
            .field("thread", &self.thread)
            .finish()
    }
}

/// `obj.<name>` as an int, calling it first if it is a method.
fn int_attr(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<i64> {
    let mut v = obj
        .getattr(name)
        .map_err(|_| invalid(format!("the coordinator has no `{name}`")))?;
    if v.is_callable() {
        v = v.call0()?;
    }
    v.extract::<i64>()
        .map_err(|_| invalid(format!("the coordinator's `{name}` is not an int: {v}")))
}

impl PyCoordinator {
    /// Check `obj` and start the thread that calls it.
    pub fn new(obj: &Bound<'_, PyAny>) -> PyResult<Arc<Self>> {
        let size = int_attr(obj, "world_size")?;
        let rank = int_attr(obj, "rank")?;
        if size < 1 || rank < 0 || rank >= size {
            return Err(invalid(format!(
                "coordinator rank {rank} of world size {size}: need 0 <= rank < world_size"
            )));
        }
        for m in ["all_gather", "broadcast"] {
            let ok = obj.getattr(m).map(|f| f.is_callable()).unwrap_or(false);
            if !ok {
                return Err(invalid(format!(
                    "the coordinator has no method `{m}` (it needs all_gather(data) and broadcast(data, root))"
                )));
            }
        }
        let label = obj.get_type().name()?.to_string();
        let target: Target = Arc::new(Mutex::new(Some(obj.clone().unbind())));
        let size = size as usize;
        let calls = PyCalls {
            target: target.clone(),
            label: label.clone(),
            size,
            has_gather: obj.getattr("gather").is_ok_and(|f| f.is_callable()),
        };
        // Any failure breaks it: a Python collective that raised (a peer's
        // connection closed) leaves the ranks out of step too.
        let (thread, ()) = CollectiveThread::spawn(
            "ckpt-coord",
            label.clone(),
            |_| true,
            move || Ok((calls, ())),
        )
        .map_err(crate::errors::to_py)?;
        Ok(Arc::new(PyCoordinator {
            rank: rank as usize,
            size,
            label,
            thread,
            target,
        }))
    }
}

/// The calls into the Python object, made on the coordination thread.
struct PyCalls {
    target: Target,
    label: String,
    size: usize,
    /// The object has `gather(data, root)`.
    has_gather: bool,
}

impl BlockingCollectives for PyCalls {
    fn all_gather(&mut self, data: Vec<u8>) -> Result<Vec<Vec<u8>>> {
        let (label, size) = (self.label.as_str(), self.size);
        call(&self.target, label, "all_gather", |obj| {
            let py = obj.py();
            let out = obj.call_method1("all_gather", (PyBytes::new(py, &data),))?;
            gathered(&out, size, label)
        })
    }

    fn gather(&mut self, data: Vec<u8>, root: usize, rank: usize) -> Result<Vec<Vec<u8>>> {
        if !self.has_gather {
            let mut all = self.all_gather(data)?;
            if rank != root {
                all.clear();
            }
            return Ok(all);
        }
        let (label, size) = (self.label.as_str(), self.size);
        call(&self.target, label, "gather", |obj| {
            let py = obj.py();
            let out = obj.call_method1("gather", (PyBytes::new(py, &data), root))?;
            if rank == root {
                gathered(&out, size, label)
            } else {
                Ok(Vec::new())
            }
        })
    }

    fn broadcast(&mut self, data: Vec<u8>, root: usize) -> Result<Vec<u8>> {
        let label = self.label.as_str();
        call(&self.target, label, "broadcast", |obj| {
            let py = obj.py();
            let out = obj.call_method1("broadcast", (PyBytes::new(py, &data), root))?;
            to_bytes(&out).ok_or_else(|| {
                invalid(format!(
                    "{label}.broadcast returned {}, not bytes",
                    type_name(&out)
                ))
            })
        })
    }
}

/// Call the object with the GIL; a Python exception becomes a ckpt error.
fn call<T>(
    target: &Target,
    label: &str,
    what: &str,
    f: impl FnOnce(&Bound<'_, PyAny>) -> PyResult<T>,
) -> Result<T> {
    Python::try_attach(|py| {
        let obj = target
            .lock_unpoisoned()
            .as_ref()
            .map(|t| t.clone_ref(py))
            .ok_or_else(|| Error::Internal(format!("{label}.{what}: the coordinator is closed")))?;
        f(obj.bind(py)).map_err(|e| {
            if e.is_instance_of::<crate::errors::InvalidInputError>(py) {
                // Our own check of what the method returned.
                Error::InvalidInput(e.value(py).to_string())
            } else {
                // The transport failed: in practice a peer died or left.
                Error::Timeout(format!(
                    "{label}.{what} failed (a rank died or stopped taking part?): {}",
                    describe(py, &e)
                ))
            }
        })
    })
    .unwrap_or_else(|| {
        Err(Error::Internal(format!(
            "{label}.{what}: the Python interpreter is shutting down"
        )))
    })
}

fn describe(py: Python<'_>, e: &PyErr) -> String {
    let ty = e
        .get_type(py)
        .name()
        .map(|n| n.to_string())
        .unwrap_or_else(|_| "Exception".into());
    format!("{ty}: {}", e.value(py))
}

fn type_name(obj: &Bound<'_, PyAny>) -> String {
    obj.get_type()
        .name()
        .map(|n| n.to_string())
        .unwrap_or_else(|_| "?".into())
}

/// Bytes out of `bytes`, `bytearray` or anything else with a byte buffer.
fn to_bytes(obj: &Bound<'_, PyAny>) -> Option<Vec<u8>> {
    if let Ok(b) = obj.cast::<PyBytes>() {
        return Some(b.as_bytes().to_vec());
    }
    let buf = pyo3::buffer::PyBuffer::<u8>::get(obj).ok()?;
    buf.to_vec(obj.py()).ok()
}

fn gathered(out: &Bound<'_, PyAny>, size: usize, label: &str) -> PyResult<Vec<Vec<u8>>> {
    let items: Vec<Bound<'_, PyAny>> =
        if out.is_instance_of::<PyList>() || out.is_instance_of::<PyTuple>() {
            out.try_iter()?.collect::<PyResult<_>>()?
        } else {
            return Err(invalid(format!(
                "{label}.all_gather returned {}, not a list of bytes",
                type_name(out)
            )));
        };
    if items.len() != size {
        return Err(invalid(format!(
            "{label}.all_gather returned {} items in a job of {size} ranks",
            items.len()
        )));
    }
    items
        .iter()
        .enumerate()
        .map(|(r, item)| {
            to_bytes(item).ok_or_else(|| {
                invalid(format!(
                    "{label}.all_gather: item {r} is {}, not bytes",
                    type_name(item)
                ))
            })
        })
        .collect()
}

#[async_trait]
impl Coordinator for PyCoordinator {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.size
    }

    async fn all_gather(&self, data: Vec<u8>, timeout: Duration) -> Result<Vec<Vec<u8>>> {
        self.thread.all_gather(data, timeout).await
    }

    async fn broadcast(&self, data: Vec<u8>, root: usize, timeout: Duration) -> Result<Vec<u8>> {
        if root >= self.size {
            return Err(Error::InvalidInput(format!(
                "broadcast root {root} in a job of {} ranks",
                self.size
            )));
        }
        self.thread.broadcast(data, root, timeout).await
    }

    async fn gather(&self, data: Vec<u8>, root: usize, timeout: Duration) -> Result<Vec<Vec<u8>>> {
        if root >= self.size {
            return Err(Error::InvalidInput(format!(
                "gather root {root} in a job of {} ranks",
                self.size
            )));
        }
        self.thread.gather(data, root, self.rank, timeout).await
    }
}
