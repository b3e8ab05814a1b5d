//! The CPU budget of background work, so that checkpointing does not take the
//! training's cores.
//!
//! The CPU-heavy steps of a save or load (blake3 of chunks and tensors, zstd,
//! verification) run through [`run_cpu`]: on tokio's blocking threads, at most
//! [`cpu_threads`] at once in the whole process, whatever the number of
//! checkpointers, saves and loads in flight. The default is every core the
//! process may use; [`set_cpu_threads`] (or `CKPT_CPU_THREADS` in the
//! environment, read once) lowers it.
//!
//! The budget is a fair semaphore: a turn given back goes to the task that
//! has waited longest, at once, and is held until that task is polled. A
//! runtime whose thread blocks in a synchronous wait (a `join` inside
//! `block_on`) while its tasks wait for turns can so hold turns that loads
//! elsewhere in the process wait for: await instead.
//!
//! Priority is the other half: [`lower_priority`] makes the calling thread
//! yield to the training's threads: a higher nice value, and batch scheduling,
//! so that waking it (a save handing its snapshot or persist to the
//! background) never preempts the thread that woke it. Call it from the
//! `on_thread_start` of the runtime that runs the engine's background work
//! (the Python package does so for its runtime, with `CKPT_BACKGROUND_NICE`,
//! default 10). The snapshot copy of an eager save runs on the thread that
//! calls `save`, so the stall keeps the caller's priority.
//!
//! ```
//! # async fn demo() -> ckpt_core::Result<()> {
//! ckpt_core::budget::set_cpu_threads(1);
//! let h = ckpt_core::budget::run_cpu(|| blake3::hash(b"chunk")).await?;
//! assert_eq!(h, blake3::hash(b"chunk"));
//! # Ok(()) }
//! ```

use std::sync::{Arc, Mutex, OnceLock};

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::error::{Error, Result};
use crate::sync::MutexExt;

/// Environment variable read (once) for the default number of CPU threads.
pub const CPU_THREADS_ENV: &str = "CKPT_CPU_THREADS";

/// The budget now in force, and the semaphore that enforces it.
fn slot() -> &'static Mutex<(usize, Arc<Semaphore>)> {
    static SLOT: OnceLock<Mutex<(usize, Arc<Semaphore>)>> = OnceLock::new();
    SLOT.get_or_init(|| {
        let n = default_threads();
        Mutex::new((n, Arc::new(Semaphore::new(n))))
    })
}

fn default_threads() -> usize {
    std::env::var(CPU_THREADS_ENV)
        .ok()
        .and_then(|v| v.trim().parse::<usize>().ok())
        .filter(|&n| n > 0)
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
}

/// How many CPU-heavy jobs of checkpointing may run at once in this process.
pub fn cpu_threads() -> usize {
    slot().lock_unpoisoned().0
}

/// Set the number of CPU-heavy jobs that may run at once (at least 1). Jobs
/// already running finish; new ones wait under the new budget.
pub fn set_cpu_threads(n: usize) {
    let n = n.max(1);
    *slot().lock_unpoisoned() = (n, Arc::new(Semaphore::new(n)));
}

/// A turn within the process's budget, for CPU-heavy work on a thread the
/// caller already has (a scoped thread working on borrowed memory); the turn
/// ends when the permit is dropped. [`run_cpu`] is the usual way in.
pub async fn cpu_permit() -> Result<OwnedSemaphorePermit> {
    let sem = slot().lock_unpoisoned().1.clone();
    sem.acquire_owned()
        .await
        .map_err(|_| Error::Internal("the CPU budget was closed".into()))
}

/// Run a CPU-heavy closure on a blocking thread, within the process's budget.
pub async fn run_cpu<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> Result<T> {
    let permit = cpu_permit().await?;
    tokio::task::spawn_blocking(move || {
        let out = f();
        drop(permit);
        out
    })
    .await
    .map_err(|e| Error::Internal(format!("worker thread: {e}")))
}

/// Lower the scheduling priority of the calling thread to `nice` above the
/// process's main thread (Linux: nice values, capped at 19; elsewhere nothing).
/// A thread already at least that low is left as it is, so a thread started by
/// an already lowered one (a blocking-pool thread spawned from a worker) ends
/// at the same level, not twice as low. Raising priority back needs
/// privileges, so call this only on threads that do background work.
///
/// With `nice` above 0 the thread is also marked batch work (Linux's
/// `SCHED_BATCH`, which keeps the nice value): the scheduler then never
/// preempts a running thread to run it when it is woken, and it gets a core at
/// the next scheduler tick or when one is free. On a host whose cores the
/// training keeps busy, a save that wakes its background threads would
/// otherwise often lose its core to one of them for a whole time slice
/// (milliseconds) before returning. Measured on 2 cores busy with training:
/// about half of the lazy saves stalled 2-8 ms instead of under 1 ms, about a
/// fifth under batch scheduling (a thread whose time slice is spent can still
/// be descheduled then); the loop's slowdown stayed the same.
pub fn lower_priority(nice: i32) -> std::io::Result<()> {
    #[cfg(target_os = "linux")]
    {
        if nice > 0 {
            batch_scheduling()?;
        }
        // SAFETY: plain system calls about this process's threads; no memory is shared.
        unsafe {
            let tid = libc::syscall(libc::SYS_gettid) as libc::id_t;
            // With a process id, getpriority reads the main thread's value.
            let base = libc::getpriority(libc::PRIO_PROCESS, libc::getpid() as libc::id_t);
            let now = libc::getpriority(libc::PRIO_PROCESS, tid);
            let want = (base + nice.max(0)).min(19);
            if now < want && libc::setpriority(libc::PRIO_PROCESS, tid, want) != 0 {
                return Err(std::io::Error::last_os_error());
            }
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = nice;
    Ok(())
}

/// Put the calling thread under `SCHED_BATCH`, keeping its nice value (the
/// legacy `sched_setscheduler` call leaves it as it is); a thread that is not
/// under the default policy (real-time, idle) is left alone.
#[cfg(target_os = "linux")]
fn batch_scheduling() -> std::io::Result<()> {
    // SAFETY: plain system calls about the calling thread (pid 0); the
    // parameter struct lives across the call.
    unsafe {
        if libc::sched_getscheduler(0) != libc::SCHED_OTHER {
            return Ok(());
        }
        let param = libc::sched_param { sched_priority: 0 };
        if libc::sched_setscheduler(0, libc::SCHED_BATCH, &param) != 0 {
            return Err(std::io::Error::last_os_error());
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn no_more_than_the_budget_runs_at_once() {
        set_cpu_threads(2);
        assert_eq!(cpu_threads(), 2);
        let running = Arc::new(AtomicUsize::new(0));
        let most = Arc::new(AtomicUsize::new(0));
        let jobs: Vec<_> = (0..12)
            .map(|_| {
                let (running, most) = (running.clone(), most.clone());
                run_cpu(move || {
                    let now = running.fetch_add(1, Ordering::SeqCst) + 1;
                    most.fetch_max(now, Ordering::SeqCst);
                    std::thread::sleep(std::time::Duration::from_millis(5));
                    running.fetch_sub(1, Ordering::SeqCst);
                })
            })
            .collect();
        for r in futures::future::join_all(jobs).await {
            r.unwrap();
        }
        assert!(most.load(Ordering::SeqCst) <= 2);
        assert!(most.load(Ordering::SeqCst) >= 1);
        set_cpu_threads(default_threads());
    }

    #[test]
    fn a_lowered_thread_sits_that_far_below_the_main_thread_once() {
        #[cfg(target_os = "linux")]
        {
            let nice_of = |tid: libc::id_t| unsafe { libc::getpriority(libc::PRIO_PROCESS, tid) };
            let main = nice_of(unsafe { libc::getpid() } as libc::id_t);
            let (first, second) = std::thread::spawn(move || {
                let tid = unsafe { libc::syscall(libc::SYS_gettid) as libc::id_t };
                lower_priority(5).unwrap();
                let first = nice_of(tid);
                // A thread started by a lowered thread inherits its value; lowering
                // it again keeps it there.
                let second = std::thread::spawn(move || {
                    let tid = unsafe { libc::syscall(libc::SYS_gettid) as libc::id_t };
                    lower_priority(5).unwrap();
                    nice_of(tid)
                })
                .join()
                .unwrap();
                (first, second)
            })
            .join()
            .unwrap();
            assert_eq!(first, (main + 5).min(19));
            assert_eq!(second, first);
        }
    }

    #[test]
    fn a_lowered_thread_is_batch_work_and_its_caller_is_not() {
        #[cfg(target_os = "linux")]
        {
            let policy = || unsafe { libc::sched_getscheduler(0) };
            let before = policy();
            let (lowered, kept) = std::thread::spawn(move || {
                let kept = std::thread::spawn(move || {
                    lower_priority(0).unwrap();
                    policy()
                })
                .join()
                .unwrap();
                lower_priority(3).unwrap();
                (policy(), kept)
            })
            .join()
            .unwrap();
            assert_eq!(lowered, libc::SCHED_BATCH);
            // Nice 0 keeps the caller's scheduling whole.
            assert_eq!(kept, before);
            assert_eq!(policy(), before);
        }
    }
}
