//! Noise generators for the interference experiment. Each loads one local
//! resource (memory bandwidth, a scratch file on local disk, CPU, 127.0.0.1
//! loopback sockets) with `intensity` threads, stops when dropped or at its
//! deadline, whichever comes first, and counts the work it did.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use serde::Serialize;

/// Which resource to load.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum NoiseKind {
    /// Memory bandwidth: large buffer copies.
    Memory,
    /// Disk: sequential writes with fsync to a scratch file (truncated as it grows).
    Disk,
    /// CPU: arithmetic on registers.
    Cpu,
    /// Loopback network: TCP over 127.0.0.1.
    Network,
}

impl NoiseKind {
    /// All kinds.
    pub const ALL: [NoiseKind; 4] = [
        NoiseKind::Memory,
        NoiseKind::Disk,
        NoiseKind::Cpu,
        NoiseKind::Network,
    ];

    /// Display name.
    pub fn name(self) -> &'static str {
        match self {
            NoiseKind::Memory => "memory bandwidth",
            NoiseKind::Disk => "disk write+fsync",
            NoiseKind::Cpu => "cpu",
            NoiseKind::Network => "loopback network",
        }
    }
}

/// A running noise generator; stops and joins its threads when dropped.
pub struct Noise {
    stop: Arc<AtomicBool>,
    work: Arc<AtomicU64>,
    threads: Vec<JoinHandle<()>>,
    started: Instant,
    scratch: Option<PathBuf>,
}

fn running(stop: &AtomicBool, deadline: Instant) -> bool {
    !stop.load(Ordering::Relaxed) && Instant::now() < deadline
}

impl Noise {
    /// Start `kind` with `intensity` threads (at least 1) for at most `max`;
    /// the disk generator writes under `dir`.
    pub fn start(
        kind: NoiseKind,
        intensity: usize,
        dir: &Path,
        max: Duration,
    ) -> std::io::Result<Noise> {
        let stop = Arc::new(AtomicBool::new(false));
        let work = Arc::new(AtomicU64::new(0));
        let deadline = Instant::now() + max;
        let mut threads = Vec::new();
        let mut scratch = None;
        let n = intensity.max(1);
        match kind {
            NoiseKind::Memory => {
                for _ in 0..n {
                    let (s, w) = (stop.clone(), work.clone());
                    threads.push(std::thread::spawn(move || {
                        let src = vec![7u8; 64 << 20];
                        let mut dst = vec![0u8; 64 << 20];
                        while running(&s, deadline) {
                            for (d, c) in dst.chunks_mut(8 << 20).zip(src.chunks(8 << 20)) {
                                d.copy_from_slice(c);
                                std::hint::black_box(&mut *d);
                                w.fetch_add(c.len() as u64, Ordering::Relaxed);
                            }
                        }
                    }));
                }
            }
            NoiseKind::Disk => {
                std::fs::create_dir_all(dir)?;
                for i in 0..n {
                    let path = dir.join(format!("noise-disk-{}-{i}.bin", std::process::id()));
                    let mut f = std::fs::File::create(&path)?;
                    scratch.get_or_insert_with(|| dir.to_path_buf());
                    let (s, w) = (stop.clone(), work.clone());
                    threads.push(std::thread::spawn(move || {
                        let block = vec![0x5Au8; 4 << 20];
                        let mut written = 0u64;
                        while running(&s, deadline) {
                            if f.write_all(&block).is_err() {
                                break;
                            }
                            written += block.len() as u64;
                            w.fetch_add(block.len() as u64, Ordering::Relaxed);
                            if written % (32 << 20) == 0 {
                                let _ = f.sync_data();
                            }
                            if written >= 256 << 20 {
                                let _ = f.set_len(0);
                                let _ = std::io::Seek::rewind(&mut f);
                                written = 0;
                            }
                        }
                        drop(f);
                        let _ = std::fs::remove_file(&path);
                    }));
                }
            }
            NoiseKind::Cpu => {
                for _ in 0..n {
                    let (s, w) = (stop.clone(), work.clone());
                    threads.push(std::thread::spawn(move || {
                        let mut x = 1.000_001f64;
                        while running(&s, deadline) {
                            for _ in 0..100_000 {
                                x = (x * 1.000_000_1).sqrt() + 0.5;
                            }
                            std::hint::black_box(x);
                            w.fetch_add(100_000, Ordering::Relaxed);
                        }
                    }));
                }
            }
            NoiseKind::Network => {
                for _ in 0..n {
                    let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
                    let addr = listener.local_addr()?;
                    let (s, w) = (stop.clone(), work.clone());
                    threads.push(std::thread::spawn(move || {
                        let Ok((mut conn, _)) = listener.accept() else {
                            return;
                        };
                        let _ = conn.set_read_timeout(Some(Duration::from_millis(100)));
                        let mut buf = vec![0u8; 1 << 20];
                        while running(&s, deadline) {
                            match conn.read(&mut buf) {
                                Ok(0) => break,
                                Ok(k) => {
                                    w.fetch_add(k as u64, Ordering::Relaxed);
                                }
                                Err(e)
                                    if matches!(
                                        e.kind(),
                                        std::io::ErrorKind::WouldBlock
                                            | std::io::ErrorKind::TimedOut
                                    ) => {}
                                Err(_) => break,
                            }
                        }
                    }));
                    let s = stop.clone();
                    let mut out = std::net::TcpStream::connect(addr)?;
                    out.set_write_timeout(Some(Duration::from_millis(100)))?;
                    threads.push(std::thread::spawn(move || {
                        let block = vec![0xA5u8; 1 << 20];
                        while running(&s, deadline) {
                            match out.write(&block) {
                                Ok(_) => {}
                                Err(e)
                                    if matches!(
                                        e.kind(),
                                        std::io::ErrorKind::WouldBlock
                                            | std::io::ErrorKind::TimedOut
                                    ) => {}
                                Err(_) => break,
                            }
                        }
                    }));
                }
            }
        }
        Ok(Noise {
            stop,
            work,
            threads,
            started: Instant::now(),
            scratch,
        })
    }

    /// Stop, join, and return the work rate (bytes/s, or operations/s for CPU).
    pub fn finish(mut self) -> f64 {
        self.halt();
        let secs = self.started.elapsed().as_secs_f64();
        self.work.load(Ordering::Relaxed) as f64 / secs.max(1e-9)
    }

    fn halt(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
        let _ = self.scratch.take();
    }
}

impl Drop for Noise {
    fn drop(&mut self) {
        self.halt();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_generator_does_work_stops_and_cleans_up() {
        let dir = tempfile::tempdir().unwrap();
        for kind in NoiseKind::ALL {
            let n = Noise::start(kind, 1, dir.path(), Duration::from_secs(5)).unwrap();
            // Give it time to start working: on a loaded machine, setting up
            // (128 MiB of buffers for Memory) can take longer than a fixed sleep.
            let started = Instant::now();
            std::thread::sleep(Duration::from_millis(150));
            while n.work.load(Ordering::Relaxed) == 0 && started.elapsed() < Duration::from_secs(4)
            {
                std::thread::sleep(Duration::from_millis(20));
            }
            let t = Instant::now();
            let rate = n.finish();
            assert!(rate > 0.0, "{kind:?} did no work");
            assert!(
                t.elapsed() < Duration::from_secs(2),
                "{kind:?} did not stop promptly"
            );
        }
        assert_eq!(
            std::fs::read_dir(dir.path()).unwrap().count(),
            0,
            "scratch files removed"
        );
    }

    #[test]
    fn generators_stop_at_their_deadline() {
        let dir = tempfile::tempdir().unwrap();
        let n = Noise::start(NoiseKind::Cpu, 1, dir.path(), Duration::from_millis(50)).unwrap();
        std::thread::sleep(Duration::from_millis(400));
        let w1 = n.work.load(Ordering::Relaxed);
        std::thread::sleep(Duration::from_millis(200));
        assert_eq!(
            n.work.load(Ordering::Relaxed),
            w1,
            "still working after the deadline"
        );
        drop(n);
    }
}
