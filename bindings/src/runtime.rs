//! One tokio runtime per process, and blocking on it from Python.
//!
//! The runtime is created lazily on first use. After `os.fork` the child has
//! none of the parent's worker threads, so a runtime inherited from the parent
//! is forgotten (never dropped: dropping would wait for threads that do not
//! exist) and the child builds its own. The pid recorded with the runtime
//! detects a fork even when the `os.register_at_fork` hook did not run.
//!
//! Every access happens with the GIL held (a [`Python`] token is required), and
//! `fork` from Python also holds the GIL, so no other thread can be inside the
//! lock at the instant of a fork.

use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use ckpt_core::sync::MutexExt;
use pyo3::prelude::*;
use tokio::runtime::Runtime;

/// How often a blocking wait comes back to check for Ctrl-C.
const SIGNAL_POLL: Duration = Duration::from_millis(50);

static RUNTIME: Mutex<Option<(u32, Arc<Runtime>)>> = Mutex::new(None);

/// The runtime of this process, created on first use.
pub fn runtime(_py: Python<'_>) -> PyResult<Arc<Runtime>> {
    let mut slot = RUNTIME.lock_unpoisoned();
    let pid = std::process::id();
    if let Some((owner, rt)) = slot.as_ref() {
        if *owner == pid {
            return Ok(rt.clone());
        }
    }
    if let Some((_, inherited)) = slot.take() {
        std::mem::forget(inherited);
    }
    let nice = background_nice();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_name("ckpt-io")
        .worker_threads(background_threads())
        .on_thread_start(move || {
            // Background work yields to the training's threads. Best effort: a
            // thread that cannot be reniced still works.
            if nice > 0 {
                let _ = ckpt_core::budget::lower_priority(nice);
            }
        })
        .build()
        .map_err(|e| crate::errors::to_py(ckpt_core::Error::Io(e)))?;
    let rt = Arc::new(rt);
    *slot = Some((pid, rt.clone()));
    Ok(rt)
}

/// Environment variable: the nice value added to the runtime's threads (the
/// persist, hashing and I/O of background saves), 0 to keep the caller's.
pub const NICE_ENV: &str = "CKPT_BACKGROUND_NICE";
/// Environment variable: the runtime's async worker threads.
pub const THREADS_ENV: &str = "CKPT_BACKGROUND_THREADS";

/// How much lower the runtime's threads run than the training (default 10).
fn background_nice() -> i32 {
    std::env::var(NICE_ENV)
        .ok()
        .and_then(|v| v.trim().parse::<i32>().ok())
        .map_or(10, |n| n.clamp(0, 19))
}

/// Async worker threads (default: the CPU budget, itself every core unless
/// `CKPT_CPU_THREADS` says less). They mostly wait on storage; CPU-heavy steps
/// go through the core's CPU budget.
fn background_threads() -> usize {
    std::env::var(THREADS_ENV)
        .ok()
        .and_then(|v| v.trim().parse::<usize>().ok())
        .filter(|&n| n > 0)
        .unwrap_or_else(ckpt_core::budget::cpu_threads)
}

/// Forget the runtime inherited from the parent (called in a fork child).
pub fn forget_after_fork() {
    let mut slot = RUNTIME.lock_unpoisoned();
    if let Some((owner, rt)) = slot.take() {
        if owner == std::process::id() {
            *slot = Some((owner, rt));
        } else {
            std::mem::forget(rt);
        }
    }
}

/// Run the future that `make` returns to completion on the runtime, with the
/// GIL released.
///
/// Every [`SIGNAL_POLL`] the GIL is taken back to run Python signal handlers, so
/// Ctrl-C raises `KeyboardInterrupt` in the middle of a long wait (the future is
/// then dropped; saves already started keep running in the background). With a
/// `timeout`, gives up after that long with `Ok(None)`.
///
/// The future is built inside the runtime thread (hence `make`), so it need not
/// be `Send` itself.
pub fn block_on<M, F>(
    py: Python<'_>,
    timeout: Option<Duration>,
    make: M,
) -> PyResult<Option<F::Output>>
where
    M: FnOnce() -> F + Send,
    F: Future,
    F::Output: Send,
{
    let rt = runtime(py)?;
    let deadline = timeout.map(|t| Instant::now() + t);
    py.detach(move || {
        rt.block_on(async move {
            let mut fut = std::pin::pin!(make());
            loop {
                let slice = match deadline {
                    Some(d) => d.saturating_duration_since(Instant::now()).min(SIGNAL_POLL),
                    None => SIGNAL_POLL,
                };
                if let Ok(out) = tokio::time::timeout(slice, fut.as_mut()).await {
                    return Ok(Some(out));
                }
                Python::attach(|py| py.check_signals())?;
                if deadline.is_some_and(|d| Instant::now() >= d) {
                    return Ok(None);
                }
            }
        })
    })
}

/// [`block_on`] without a timeout.
pub fn wait<M, F>(py: Python<'_>, make: M) -> PyResult<F::Output>
where
    M: FnOnce() -> F + Send,
    F: Future,
    F::Output: Send,
{
    Ok(block_on(py, None, make)?.expect("no timeout was set"))
}

/// Whether an object created in process `pid` may be used in this one.
pub fn check_pid(pid: u32, what: &str) -> PyResult<()> {
    if pid == std::process::id() {
        Ok(())
    } else {
        Err(crate::errors::to_py(ckpt_core::Error::InvalidInput(format!(
            "this {what} was created in process {pid} before a fork; create a new one in process {}",
            std::process::id()
        ))))
    }
}
