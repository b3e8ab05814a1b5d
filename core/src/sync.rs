//! Locks that outlive a panic.
//!
//! A `std::sync` lock is poisoned when a thread panics while holding it. Every
//! lock in ckpt guards state that each critical section leaves consistent
//! (inserts, removals, counters, `Option` slots), so a panic elsewhere is no
//! reason to fail every later save or load: these take the guard either way.
//!
//! ```
//! use std::sync::Mutex;
//! use ckpt_core::sync::MutexExt;
//! let m = Mutex::new(1);
//! *m.lock_unpoisoned() += 1;
//! assert_eq!(*m.lock_unpoisoned(), 2);
//! ```

use std::sync::{
    LockResult, Mutex, MutexGuard, PoisonError, RwLock, RwLockReadGuard, RwLockWriteGuard,
};

/// The value of a lock operation, poisoned or not.
pub fn unpoisoned<G>(result: LockResult<G>) -> G {
    result.unwrap_or_else(PoisonError::into_inner)
}

/// [`Mutex::lock`] that ignores poisoning.
pub trait MutexExt<T: ?Sized> {
    /// Lock, taking the guard even if a thread panicked while holding it.
    fn lock_unpoisoned(&self) -> MutexGuard<'_, T>;
}

impl<T: ?Sized> MutexExt<T> for Mutex<T> {
    fn lock_unpoisoned(&self) -> MutexGuard<'_, T> {
        unpoisoned(self.lock())
    }
}

/// [`RwLock::read`] and [`RwLock::write`] that ignore poisoning.
pub trait RwLockExt<T: ?Sized> {
    /// Lock for reading, poisoned or not.
    fn read_unpoisoned(&self) -> RwLockReadGuard<'_, T>;
    /// Lock for writing, poisoned or not.
    fn write_unpoisoned(&self) -> RwLockWriteGuard<'_, T>;
}

impl<T: ?Sized> RwLockExt<T> for RwLock<T> {
    fn read_unpoisoned(&self) -> RwLockReadGuard<'_, T> {
        unpoisoned(self.read())
    }

    fn write_unpoisoned(&self) -> RwLockWriteGuard<'_, T> {
        unpoisoned(self.write())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_panic_under_the_lock_does_not_lock_everyone_out() {
        let m = std::sync::Arc::new(Mutex::new(vec![1]));
        let r = std::sync::Arc::new(RwLock::new(0));
        let (m2, r2) = (m.clone(), r.clone());
        let _ = std::thread::spawn(move || {
            let _g = m2.lock().unwrap();
            let _w = r2.write().unwrap();
            panic!("poison both");
        })
        .join();
        assert!(m.lock().is_err() && r.read().is_err(), "both are poisoned");
        m.lock_unpoisoned().push(2);
        *r.write_unpoisoned() += 1;
        assert_eq!(*m.lock_unpoisoned(), [1, 2]);
        assert_eq!(*r.read_unpoisoned(), 1);
        let m = std::sync::Arc::into_inner(m).unwrap();
        assert_eq!(unpoisoned(m.into_inner()), [1, 2]);
    }
}
