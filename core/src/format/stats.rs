//! [`WriteStats`]: what a format did while it wrote, for the save's report.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// Counters a format adds to while it writes (from any task or thread); the
/// engine reads them into the [`SaveReport`](crate::SaveReport).
#[derive(Debug, Default)]
pub struct WriteStats {
    raw_bytes: AtomicU64,
    stored_bytes: AtomicU64,
    reused_bytes: AtomicU64,
    objects: AtomicU64,
    hash_ns: AtomicU64,
    encode_ns: AtomicU64,
    write_ns: AtomicU64,
}

/// The counters of a [`WriteStats`] at one moment.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct WriteTotals {
    /// Raw tensor bytes handled.
    pub raw_bytes: u64,
    /// Bytes of objects written to storage.
    pub stored_bytes: u64,
    /// Raw bytes not written because an identical chunk was already stored.
    pub reused_bytes: u64,
    /// Objects written.
    pub objects: u64,
    /// Time spent hashing, summed over tasks.
    pub hash: Duration,
    /// Time spent compressing or encoding, summed over tasks.
    pub encode: Duration,
    /// Time spent in storage writes, summed over tasks.
    pub write: Duration,
}

fn add(counter: &AtomicU64, v: u64) {
    counter.fetch_add(v, Ordering::Relaxed);
}

fn nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

impl WriteStats {
    /// Raw tensor bytes handled (written, or found already stored).
    pub fn add_raw(&self, bytes: u64) {
        add(&self.raw_bytes, bytes);
    }

    /// Raw bytes not written because identical bytes are already stored (or
    /// are being written by this save).
    pub fn add_reused(&self, bytes: u64) {
        add(&self.reused_bytes, bytes);
    }

    /// Time spent hashing.
    pub fn add_hash_time(&self, took: Duration) {
        add(&self.hash_ns, nanos(took));
    }

    /// Time spent compressing or encoding.
    pub fn add_encode_time(&self, took: Duration) {
        add(&self.encode_ns, nanos(took));
    }

    /// One object of `bytes` written, which took `took`.
    /// [`put_object`](crate::format::io::put_object) records its writes itself.
    pub fn add_stored(&self, bytes: u64, took: Duration) {
        add(&self.stored_bytes, bytes);
        add(&self.objects, 1);
        add(&self.write_ns, nanos(took));
    }

    /// The counters now.
    pub fn totals(&self) -> WriteTotals {
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        WriteTotals {
            raw_bytes: get(&self.raw_bytes),
            stored_bytes: get(&self.stored_bytes),
            reused_bytes: get(&self.reused_bytes),
            objects: get(&self.objects),
            hash: Duration::from_nanos(get(&self.hash_ns)),
            encode: Duration::from_nanos(get(&self.encode_ns)),
            write: Duration::from_nanos(get(&self.write_ns)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_add_up_across_threads() {
        let s = WriteStats::default();
        std::thread::scope(|t| {
            for _ in 0..4 {
                t.spawn(|| {
                    s.add_raw(10);
                    s.add_hash_time(Duration::from_nanos(5));
                    s.add_reused(3);
                    s.add_encode_time(Duration::from_nanos(7));
                    s.add_stored(100, Duration::from_micros(1));
                });
            }
        });
        let got = s.totals();
        assert_eq!(
            (
                got.raw_bytes,
                got.reused_bytes,
                got.stored_bytes,
                got.objects
            ),
            (40, 12, 400, 4)
        );
        assert_eq!(got.hash, Duration::from_nanos(20));
        assert_eq!(got.encode, Duration::from_nanos(28));
        assert_eq!(got.write, Duration::from_micros(4));
    }
}
