//! Failpoints: named places in the save and commit path where a test can make
//! the process fail, exactly there.
//!
//! Compiled in only with the `failpoints` feature; without it the engine's calls
//! are empty inline functions and only [`NAMES`] is here. Armed either from code
//! (`set`) or, for crash tests of a child process, from the environment:
//! `CKPT_FAILPOINTS="save.before_manifest=abort;..."`.
//!
//! Actions: `error` (the operation returns an error), `enospc` (it fails as a
//! full disk makes a local store fail: a storage error carrying `ENOSPC`, for
//! tests that need one rank's disk full while the others' are not), `abort` (the
//! process dies at once, like a SIGKILL: no destructors, no flush), `panic`,
//! `sleep(MS)` (the task waits on tokio's timer; its worker thread runs other
//! tasks meanwhile), and `N*ACTION` to act only on the N-th hit (1-based). An unknown
//! action, or a `sleep` without a number, fails the operation with
//! [`Error::InvalidInput`](crate::Error::InvalidInput) naming it.
//!
//! The places, in the order a save passes them:
//! `save.start`, `save.before_data`, `save.mid_data` (after the first object of the
//! save is durable), `save.after_data`, `save.before_manifest`, `save.after_manifest`,
//! `gc.before_delete`.

use crate::error::Result;

/// Every failpoint name, in save order.
pub const NAMES: &[&str] = &[
    "save.start",
    "save.before_data",
    "save.mid_data",
    "save.after_data",
    "save.before_manifest",
    "save.after_manifest",
    "gc.before_delete",
];

#[cfg(feature = "failpoints")]
mod imp {
    use super::*;
    use crate::error::Error;
    use crate::sync::MutexExt;
    use std::collections::HashMap;
    use std::sync::{Mutex, OnceLock};

    #[derive(Debug, Clone)]
    struct Armed {
        action: String,
        nth: Option<u64>,
        hits: u64,
    }

    fn table() -> &'static Mutex<HashMap<String, Armed>> {
        static T: OnceLock<Mutex<HashMap<String, Armed>>> = OnceLock::new();
        T.get_or_init(|| {
            let mut map = HashMap::new();
            if let Ok(spec) = std::env::var("CKPT_FAILPOINTS") {
                for item in spec.split(';').filter(|s| !s.is_empty()) {
                    if let Some((name, action)) = item.split_once('=') {
                        map.insert(name.to_owned(), parse(action));
                    }
                }
            }
            Mutex::new(map)
        })
    }

    fn parse(action: &str) -> Armed {
        match action.split_once('*') {
            Some((n, a)) if n.parse::<u64>().is_ok() => Armed {
                action: a.to_owned(),
                nth: n.parse().ok(),
                hits: 0,
            },
            _ => Armed {
                action: action.to_owned(),
                nth: None,
                hits: 0,
            },
        }
    }

    pub fn set(name: &str, action: &str) {
        table()
            .lock_unpoisoned()
            .insert(name.to_owned(), parse(action));
    }

    pub fn clear_all() {
        table().lock_unpoisoned().clear();
    }

    pub async fn hit(name: &str) -> Result<()> {
        let action = {
            let mut t = table().lock_unpoisoned();
            let Some(armed) = t.get_mut(name) else {
                return Ok(());
            };
            armed.hits += 1;
            match armed.nth {
                Some(n) if n != armed.hits => return Ok(()),
                _ => armed.action.clone(),
            }
        };
        match action.as_str() {
            "error" => Err(Error::Internal(format!("failpoint `{name}` triggered"))),
            "enospc" => Err(Error::Storage(object_store::Error::Generic {
                store: "failpoint",
                source: Box::new(std::io::Error::from_raw_os_error(28)),
            })),
            "abort" => std::process::abort(),
            "panic" => panic!("failpoint `{name}` triggered"),
            a if a.starts_with("sleep(") => {
                let ms: u64 = a
                    .strip_prefix("sleep(")
                    .and_then(|a| a.strip_suffix(')'))
                    .and_then(|n| n.parse().ok())
                    .ok_or_else(|| {
                        Error::InvalidInput(format!("failpoint `{name}`: bad action `{a}`"))
                    })?;
                // On the timer, not the thread: the worker runs other tasks meanwhile.
                tokio::time::sleep(std::time::Duration::from_millis(ms)).await;
                Ok(())
            }
            a => Err(Error::InvalidInput(format!(
                "failpoint `{name}`: unknown action `{a}` (error, enospc, abort, panic, sleep(MS))"
            ))),
        }
    }
}

/// Pass a failpoint: does nothing unless a test armed it.
#[cfg(feature = "failpoints")]
pub(crate) async fn hit(name: &str) -> Result<()> {
    imp::hit(name).await
}

/// Pass a failpoint: does nothing unless a test armed it.
#[cfg(not(feature = "failpoints"))]
#[inline(always)]
pub(crate) async fn hit(_name: &str) -> Result<()> {
    Ok(())
}

/// Arm a failpoint with an action (see the module docs).
#[cfg(feature = "failpoints")]
pub fn set(name: &str, action: &str) {
    imp::set(name, action)
}

/// Disarm every failpoint.
#[cfg(feature = "failpoints")]
pub fn clear_all() {
    imp::clear_all()
}

#[cfg(all(test, feature = "failpoints"))]
mod tests {
    use std::time::{Duration, Instant};

    #[tokio::test(flavor = "current_thread")]
    async fn sleep_leaves_the_worker_free() {
        super::set("test.sleep", "sleep(300)");
        let start = Instant::now();
        let sleeper = tokio::spawn(super::hit("test.sleep"));
        // One worker thread: this task only wakes on time if the sleeper yields it.
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(start.elapsed() < Duration::from_millis(250));
        sleeper.await.unwrap().unwrap();
        assert!(start.elapsed() >= Duration::from_millis(300));
    }
}
