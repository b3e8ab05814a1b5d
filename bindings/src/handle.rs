//! A save in progress, as seen from Python.
//!
//! `ckpt_core::SaveHandle::wait` consumes the handle, but a Python wait may be
//! interrupted (Ctrl-C, a timeout) and retried, and may be asked twice. So a
//! small task on the runtime owns the core handle, waits for the snapshot and
//! then for the commit, and publishes both outcomes on watch channels that any
//! number of Python calls can wait on.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use ckpt_core::{Error, LaterSnapshot, SaveReport, SharedSnapshot, Value};
use pyo3::prelude::*;
use pyo3::types::PyDict;
use tokio::sync::watch;

use crate::args::TensorSpec;
use crate::errors::{to_py, to_py_ref};
use crate::runtime::{self, check_pid};

type Outcome<T> = Option<Arc<Result<T, Error>>>;

/// A save that was started by `Checkpointer.save`; the snapshot may still be
/// copying and the checkpoint is durable only once `wait()` returned.
#[pyclass(frozen, module = "ckpt._ckpt")]
pub struct SaveHandle {
    #[pyo3(get)]
    step: u64,
    #[pyo3(get)]
    attempt: String,
    stall: Duration,
    snapshot: watch::Receiver<Outcome<()>>,
    done: watch::Receiver<Outcome<SaveReport>>,
    pid: u32,
    /// A save made with `share=True`: its snapshot (eager: the tensors, until
    /// `snapshot_specs` takes them; lazy: the snapshot once taken, until
    /// another checkpointer's `save_after` takes it).
    taken: Mutex<Option<SharedSnapshot>>,
    /// A lazy save made with `share=True`: its metadata's `state` tree as
    /// converted once, for the `save_after` that takes its snapshot.
    state: Mutex<Option<Value>>,
}

impl SaveHandle {
    /// What this save shares with another checkpointer's (see `taken`).
    fn shared(&self) -> PyResult<std::sync::MutexGuard<'_, Option<SharedSnapshot>>> {
        self.taken
            .lock()
            .map_err(|_| to_py(Error::Internal("a snapshot lock was poisoned".into())))
    }

    /// A lazy save's snapshot for another checkpointer's save of it, taken
    /// out of this handle (once): `None` for an eager or unshared save, and
    /// once taken.
    pub(crate) fn take_later(&self) -> PyResult<Option<LaterSnapshot>> {
        let mut taken = self.shared()?;
        match taken.take() {
            Some(SharedSnapshot::Later(later)) => Ok(Some(later)),
            other => {
                *taken = other;
                Ok(None)
            }
        }
    }

    /// The `state` tree of this save's metadata, taken out of this handle
    /// (once; see `state`).
    pub(crate) fn take_state(&self) -> Option<Value> {
        self.state.lock().ok().and_then(|mut s| s.take())
    }

    /// Keep `state` (this shared save's metadata tree) for `take_state`.
    pub(crate) fn keep_state(self, state: Option<Value>) -> Self {
        if let Ok(mut s) = self.state.lock() {
            *s = state;
        }
        self
    }

    /// Watch a core handle from a task on the runtime; `shared` is the
    /// snapshot `save_shared` handed back.
    pub fn spawn(
        rt: &tokio::runtime::Runtime,
        handle: ckpt_core::SaveHandle,
        shared: Option<SharedSnapshot>,
    ) -> Self {
        // An eager save returns with its snapshot already taken: say so at once.
        let taken = handle.snapshot_done().then(|| Arc::new(Ok(())));
        let (snap_tx, snapshot) = watch::channel(taken);
        let (done_tx, done) = watch::channel(None);
        let id = handle.id().clone();
        let stall = handle.stall();
        rt.spawn(async move {
            let snap = handle.wait_snapshot().await;
            let _ = snap_tx.send(Some(Arc::new(snap)));
            let r = handle.wait().await;
            let _ = done_tx.send(Some(Arc::new(r)));
        });
        SaveHandle {
            step: id.step,
            attempt: id.attempt,
            stall,
            snapshot,
            done,
            pid: std::process::id(),
            taken: Mutex::new(shared),
            state: Mutex::new(None),
        }
    }
}

/// A timeout given in seconds from Python (`None`: wait without limit).
pub(crate) fn timeout_of(timeout: Option<f64>) -> PyResult<Option<Duration>> {
    timeout
        .map(|t| {
            Duration::try_from_secs_f64(t).map_err(|_| {
                crate::errors::invalid(format!(
                    "timeout must be a non-negative number of seconds, not {t}"
                ))
            })
        })
        .transpose()
}

/// Wait until a watch channel holds an outcome.
fn wait_outcome<T: Send + Sync>(
    py: Python<'_>,
    rx: &watch::Receiver<Outcome<T>>,
    timeout: Option<f64>,
    what: &str,
) -> PyResult<Arc<Result<T, Error>>> {
    let mut rx = rx.clone();
    let wait = move || async move {
        rx.wait_for(Option::is_some)
            .await
            .ok()
            .and_then(|v| v.clone())
    };
    match runtime::block_on(py, timeout_of(timeout)?, wait)? {
        Some(Some(out)) => Ok(out),
        Some(None) => Err(to_py(Error::Internal(format!("the {what} task vanished")))),
        None => Err(to_py(Error::Timeout(format!(
            "{what} not finished after {} s",
            timeout.unwrap_or(0.0)
        )))),
    }
}

#[pymethods]
impl SaveHandle {
    /// Seconds the engine's `save` took, its part of the stall (the Python
    /// `SaveHandle.stall` is the whole call).
    #[getter]
    fn stall(&self) -> f64 {
        self.stall.as_secs_f64()
    }

    /// True once the snapshot is complete (or failed) and the state may change again.
    fn snapshot_done(&self) -> bool {
        self.snapshot.borrow().is_some()
    }

    /// True once the save is committed or failed.
    fn done(&self) -> bool {
        self.done.borrow().is_some()
    }

    /// Block until the snapshot copy is complete; raise its error if it failed.
    #[pyo3(signature = (timeout=None))]
    fn wait_snapshot(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<()> {
        check_pid(self.pid, "SaveHandle")?;
        let out = wait_outcome(py, &self.snapshot, timeout, "snapshot")?;
        out.as_ref().as_ref().map(|_| ()).map_err(to_py_ref)
    }

    /// Block until the checkpoint is durable and committed; return the save's
    /// report (a dict of timings in seconds and byte counts) or raise its error.
    #[pyo3(signature = (timeout=None))]
    fn wait<'py>(&self, py: Python<'py>, timeout: Option<f64>) -> PyResult<Bound<'py, PyDict>> {
        check_pid(self.pid, "SaveHandle")?;
        let out = wait_outcome(py, &self.done, timeout, "save")?;
        match out.as_ref() {
            Ok(r) => report(py, r),
            Err(e) => Err(to_py_ref(e)),
        }
    }

    /// An eager save started with `share=True`: its snapshot as
    /// `TensorSpec`s whose bytes are the snapshot's own (`SnapshotBytes`), so
    /// that another checkpointer's `save` of them copies nothing. Given once;
    /// `None` after that, and for lazy or unshared saves. Until that other save
    /// is done with them, this save's staging memory stays in use.
    fn snapshot_specs(&self, py: Python<'_>) -> PyResult<Option<Vec<TensorSpec>>> {
        let ts = {
            let mut taken = self.shared()?;
            match taken.take() {
                Some(SharedSnapshot::Taken(ts)) => ts,
                other => {
                    *taken = other;
                    return Ok(None);
                }
            }
        };
        ts.into_iter()
            .map(|t| TensorSpec::shared(py, t.name, t.dtype, t.shape, t.shard, t.data))
            .collect::<PyResult<Vec<_>>>()
            .map(Some)
    }

    fn __repr__(&self) -> String {
        let state = if self.done() {
            "done"
        } else if self.snapshot_done() {
            "persisting"
        } else {
            "snapshotting"
        };
        format!(
            "SaveHandle(step={}, attempt={:?}, {state})",
            self.step, self.attempt
        )
    }
}

/// A [`SaveReport`] as a dict.
fn report<'py>(py: Python<'py>, r: &SaveReport) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("step", r.id.step)?;
    d.set_item("attempt", &r.id.attempt)?;
    for (k, v) in [
        ("stall", r.stall),
        ("snapshot", r.snapshot),
        ("persist", r.persist),
        ("commit", r.commit),
        ("total", r.total),
        ("hash_cpu", r.hash_cpu),
        ("encode_cpu", r.encode_cpu),
        ("write_io", r.write_io),
    ] {
        d.set_item(k, v.as_secs_f64())?;
    }
    for (k, v) in [
        ("raw_bytes", r.raw_bytes),
        ("copied_bytes", r.copied_bytes),
        ("stored_bytes", r.stored_bytes),
        ("reused_bytes", r.reused_bytes),
        ("objects", r.objects),
    ] {
        d.set_item(k, v)?;
    }
    Ok(d)
}
