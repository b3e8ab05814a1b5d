//! The machine's own limits, measured in the same run as the experiments so every
//! figure can be given as a ratio to them.

use std::io::Write;
use std::path::Path;
use std::time::Instant;

use ckpt_core::State;

/// Seconds to copy every tensor of `state` into warm (already touched) buffers on
/// one thread: the floor for a blocking snapshot.
pub fn memcpy_secs(state: &State) -> f64 {
    let mut dst: Vec<Vec<u8>> = state
        .tensors
        .iter()
        .map(|t| vec![1u8; t.data.len()])
        .collect();
    // Touch once so page faults are not counted, then time the copy.
    for (d, t) in dst.iter_mut().zip(&state.tensors) {
        d.copy_from_slice(&t.data);
    }
    let start = Instant::now();
    for (d, t) in dst.iter_mut().zip(&state.tensors) {
        d.copy_from_slice(&t.data);
    }
    let secs = start.elapsed().as_secs_f64();
    std::hint::black_box(&dst);
    secs
}

/// Seconds to write the state's bytes sequentially to one new file in `dir` and
/// fsync it (and the directory): the floor for persisting to that disk.
pub fn raw_write_fsync_secs(state: &State, dir: &Path) -> std::io::Result<f64> {
    std::fs::create_dir_all(dir)?;
    let path = dir.join(format!("raw-baseline-{}.bin", std::process::id()));
    let start = Instant::now();
    let mut f = std::fs::File::create(&path)?;
    for t in &state.tensors {
        f.write_all(&t.data)?;
    }
    f.sync_all()?;
    std::fs::File::open(dir)?.sync_all()?;
    let secs = start.elapsed().as_secs_f64();
    drop(f);
    std::fs::remove_file(&path)?;
    Ok(secs)
}

/// Ask the kernel to drop a file's pages from the page cache (after fsync, so
/// nothing dirty is left), so the next read comes from the disk. Returns whether
/// the advice was accepted (Linux: `posix_fadvise(POSIX_FADV_DONTNEED)`).
pub fn drop_cache(path: &Path) -> bool {
    #[cfg(target_os = "linux")]
    {
        use std::os::fd::AsRawFd;
        let Ok(f) = std::fs::File::open(path) else {
            return false;
        };
        if f.sync_all().is_err() {
            return false;
        }
        // SAFETY: the descriptor is open for the duration of the call.
        unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) == 0 }
    }
    #[cfg(not(target_os = "linux"))]
    {
        let _ = path;
        false
    }
}

/// Drop the page cache of every file under `dir` (see [`drop_cache`]); returns
/// whether it was accepted for all of them.
pub fn drop_cache_tree(dir: &Path) -> bool {
    let mut ok = true;
    let Ok(entries) = std::fs::read_dir(dir) else {
        return drop_cache(dir);
    };
    for e in entries.flatten() {
        let p = e.path();
        ok &= if p.is_dir() {
            drop_cache_tree(&p)
        } else {
            drop_cache(&p)
        };
    }
    ok
}

/// Sequential read of a file just written and fsynced, with its page cache dropped
/// where the OS allows it: the floor for loading from that disk.
#[derive(Debug, Clone, Copy)]
pub struct ColdRead {
    /// Seconds to read the state's bytes.
    pub secs: f64,
    /// Whether the page cache could be dropped (else the figure is a warm read).
    pub cache_dropped: bool,
}

/// Write the state's bytes to a file in `dir`, fsync, drop its cache, and time
/// reading it back in 8 MiB blocks.
pub fn cold_read_secs(state: &State, dir: &Path) -> std::io::Result<ColdRead> {
    use std::io::Read;
    std::fs::create_dir_all(dir)?;
    let path = dir.join(format!("read-baseline-{}.bin", std::process::id()));
    {
        let mut f = std::fs::File::create(&path)?;
        for t in &state.tensors {
            f.write_all(&t.data)?;
        }
        f.sync_all()?;
    }
    let cache_dropped = drop_cache(&path);
    let mut buf = vec![0u8; 8 << 20];
    let start = Instant::now();
    let mut f = std::fs::File::open(&path)?;
    let mut total = 0usize;
    loop {
        let n = f.read(&mut buf)?;
        if n == 0 {
            break;
        }
        total += n;
    }
    let secs = start.elapsed().as_secs_f64();
    std::hint::black_box(total);
    std::fs::remove_file(&path)?;
    Ok(ColdRead {
        secs,
        cache_dropped,
    })
}

/// The machine's floors for one state size, each a summary over repeats.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Limits {
    /// Bytes of the state they were measured with.
    pub bytes: u64,
    /// memcpy of the state, seconds.
    pub memcpy_s: crate::stats::Summary,
    /// Sequential write + fsync, seconds.
    pub write_fsync_s: crate::stats::Summary,
    /// Sequential read with the page cache dropped, seconds.
    pub read_cold_s: crate::stats::Summary,
    /// Whether the page cache could be dropped for the read.
    pub cache_dropped: bool,
}

impl Limits {
    /// Measure all three floors `repeats` times on `state`, using `dir`.
    pub fn measure(state: &State, dir: &Path, repeats: usize) -> std::io::Result<Limits> {
        let (mut m, mut w, mut r) = (vec![], vec![], vec![]);
        let mut dropped = true;
        for _ in 0..repeats.max(1) {
            m.push(memcpy_secs(state));
            w.push(raw_write_fsync_secs(state, dir)?);
            let c = cold_read_secs(state, dir)?;
            dropped &= c.cache_dropped;
            r.push(c.secs);
        }
        Ok(Limits {
            bytes: state.nbytes(),
            memcpy_s: crate::stats::Summary::of(&m),
            write_fsync_s: crate::stats::Summary::of(&w),
            read_cold_s: crate::stats::Summary::of(&r),
            cache_dropped: dropped,
        })
    }

    /// GB/s (10^9 bytes per second) of a time over `bytes`.
    pub fn gbps(bytes: u64, secs: f64) -> f64 {
        if secs <= 0.0 {
            0.0
        } else {
            bytes as f64 / secs / 1e9
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn floors_are_measured_and_positive() {
        let dir = tempfile::tempdir().unwrap();
        let state = crate::workload::uniform_f32(4, 1 << 20, 7);
        let l = Limits::measure(&state, dir.path(), 2).unwrap();
        assert_eq!(l.bytes, 1 << 20);
        assert_eq!(l.memcpy_s.n, 2);
        assert!(l.write_fsync_s.min > 0.0 && l.read_cold_s.min > 0.0);
        // Nothing is left behind in the directory.
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
        assert_eq!(Limits::gbps(2_000_000_000, 2.0), 1.0);
        assert_eq!(Limits::gbps(1, 0.0), 0.0);
    }
}
