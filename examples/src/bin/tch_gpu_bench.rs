//! The stall of a GPU save against a plain device-to-host copy of the same tensors.
//!
//! ```text
//! tch_gpu_bench [--mib 1024] [--tensors 64] [--repeats 5] [--cpu]
//! ```
//!
//! For a state of `--tensors` float32 CUDA tensors totalling `--mib` MiB, it times
//! (median of `--repeats`):
//! - `plain copy`: `Tensor::to(Cpu)` of every tensor (blocking, pageable memory),
//!   the floor a naive checkpoint pays before training may go on;
//! - `pinned copy`: non-blocking copies into pinned memory and one synchronise;
//! - `save stall, eager`: `Checkpointer::save` of a `TorchCapture` of the tensors
//!   until it returns (pinned copies, synchronise, copy into staging);
//! - `save stall, eager, settled`: the same with `TorchCapture::settle` (the
//!   pinned buffers are handed over as they are: no staging copy);
//! - `save stall, lazy`: the same in lazy mode (the copies are only queued), and
//!   the time until the lazy snapshot is complete.
//!
//! and prints each as seconds, GB/s and a ratio to the plain copy. The saves go to
//! an in-memory store, so persisting does not touch the disk. Without a CUDA device
//! it prints that it skipped and exits successfully; `--cpu` runs the same on CPU
//! tensors instead (plain copy: a clone; no pinned rows).

use std::time::{Duration, Instant};

use clap::Parser;

use ckpt_core::torch::tch::{self, Device, Kind, Tensor};
use ckpt_core::torch::TorchCapture;
use ckpt_core::{Retention, SnapshotMode};

/// The stall of a GPU save against a plain device-to-host copy.
#[derive(Debug, Parser)]
struct Args {
    /// Total size of the state, MiB.
    #[arg(long, default_value_t = 1024)]
    mib: u64,
    /// Number of float32 tensors.
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u64).range(1..))]
    tensors: u64,
    /// Timed repeats of each measurement (median).
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u64).range(1..))]
    repeats: u64,
    /// Run on CPU tensors instead of CUDA ones.
    #[arg(long)]
    cpu: bool,
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

/// Wait for the GPU (nothing to wait for on CPU).
fn sync(device: Device) {
    if device.is_cuda() {
        tch::Cuda::synchronize(0);
    }
}

fn state(mib: u64, n: u64, device: Device) -> Vec<Tensor> {
    let per = (mib << 20) / 4 / n;
    (0..n)
        .map(|_| Tensor::randn([per as i64], (Kind::Float, device)))
        .collect()
}

fn capture(ts: &[Tensor], settle: bool) -> TorchCapture {
    let mut cap = TorchCapture::new();
    for (i, t) in ts.iter().enumerate() {
        cap.tensor(format!("t{i:03}"), t).expect("capture");
    }
    if settle {
        cap.settle().expect("settle");
    }
    cap
}

async fn saves(ts: &[Tensor], lazy: bool, settle: bool, repeats: u64) -> (Duration, Duration) {
    let device = ts[0].device();
    let mut b = ckpt_formats::builder(format!("memory://gpu-bench-{lazy}-{settle}"))
        .retention(Retention::keep_last(1));
    if lazy {
        b = b.snapshot(SnapshotMode::Lazy);
    }
    let cp = b.build().await.expect("checkpointer");
    let (mut stalls, mut snaps) = (Vec::new(), Vec::new());
    for step in 0..=repeats {
        sync(device);
        let start = Instant::now();
        let h = cp.save(step, capture(ts, settle)).await.expect("save");
        let stall = start.elapsed();
        h.wait_snapshot().await.expect("snapshot");
        let snap = start.elapsed();
        h.wait().await.expect("persist");
        if step > 0 {
            // The first save sizes the staging pool; it is not timed.
            stalls.push(stall);
            snaps.push(snap);
        }
    }
    (median(stalls), median(snaps))
}

#[tokio::main]
async fn main() {
    let args = Args::parse();
    let device = if args.cpu {
        Device::Cpu
    } else if tch::Cuda::is_available() {
        Device::Cuda(0)
    } else {
        println!("tch_gpu_bench: skipped: no CUDA device (libtorch sees none); --cpu runs it on CPU tensors");
        return;
    };
    let (mib, n, repeats) = (args.mib, args.tensors, args.repeats);
    let ts = state(mib, n, device);
    let bytes: u64 = ts.iter().map(|t| (t.numel() * 4) as u64).sum();
    sync(device);

    let time = |f: &dyn Fn()| {
        let v = (0..=repeats)
            .map(|_| {
                sync(device);
                let s = Instant::now();
                f();
                s.elapsed()
            })
            .skip(1)
            .collect();
        median(v)
    };
    let plain = time(&|| {
        let host: Vec<Tensor> = if device.is_cuda() {
            ts.iter().map(|t| t.to_device(Device::Cpu)).collect()
        } else {
            ts.iter().map(|t| t.copy()).collect()
        };
        drop(host);
    });
    let mut rows = vec![("plain copy (to CPU memory)", plain)];
    if device.is_cuda() {
        let pinned = time(&|| {
            let host: Vec<Tensor> = ts
                .iter()
                .map(|t| t.to_device_(Device::Cpu, Kind::Float, true, true))
                .collect();
            sync(device);
            drop(host);
        });
        rows.push(("pinned copy (non-blocking + sync)", pinned));
    }
    let (eager, _) = saves(&ts, false, false, repeats).await;
    rows.push(("save stall, eager", eager));
    if device.is_cuda() {
        let (settled, _) = saves(&ts, false, true, repeats).await;
        rows.push(("save stall, eager, settled", settled));
    }
    let (lazy, lazy_snap) = saves(&ts, true, false, repeats).await;
    rows.push(("save stall, lazy", lazy));
    rows.push(("lazy snapshot complete", lazy_snap));

    println!(
        "state: {n} float32 tensors on {device:?}, {:.1} MiB; median of {repeats}",
        bytes as f64 / (1u64 << 20) as f64
    );
    println!(
        "{:<34} {:>10} {:>9} {:>12}",
        "what", "seconds", "GB/s", "vs plain"
    );
    for (what, d) in rows {
        println!(
            "{what:<34} {:>10.4} {:>9.2} {:>12.3}",
            d.as_secs_f64(),
            bytes as f64 / d.as_secs_f64() / 1e9,
            d.as_secs_f64() / plain.as_secs_f64()
        );
    }
}
