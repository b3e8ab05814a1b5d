//! Data-parallel training under `mpirun` that checkpoints every N steps and resumes.
//!
//! ```sh
//! mpirun -np 4 target/debug/mpi_train --root /tmp/dp --steps 40 --every 5 --out /tmp/dp.weights
//! ```
//!
//! A linear model `y = W x` trained with SGD on generated data. Each rank draws its
//! own batch (seeded by step and rank), computes its gradient, and the ranks average
//! gradients through the same [`Coordinator`] the checkpointer commits with
//! (all-gather, summed in rank order, so every rank holds bitwise the same `W`).
//! Every `every` steps all ranks save: `W` is the same on every rank, so it is a
//! replicated tensor and is written once in total; each rank's data cursor is
//! rank-local state under its own name. On start, every rank resumes from the
//! newest intact checkpoint. `--die-at STEP --die-rank R` makes rank R abort at the
//! start of that step (before its save), as a crash would.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use clap::Parser;

use ckpt_core::coord::MpiCoordinator;
use ckpt_core::{Coordinator, DType, State, Tensor, Value};

const IN: usize = 64;
const OUT: usize = 16;
const BATCH: usize = 32;

/// Data-parallel training under mpirun that checkpoints and resumes.
#[derive(Parser, Debug)]
#[command(name = "mpi_train")]
struct Args {
    /// Checkpoint root directory.
    #[arg(long)]
    root: String,
    /// Train until this many steps are done.
    #[arg(long, default_value_t = 40)]
    steps: u64,
    /// Checkpoint every this many steps.
    #[arg(long, default_value_t = 5)]
    every: u64,
    /// Rank `--die-rank` aborts at the start of this step.
    #[arg(long)]
    die_at: Option<u64>,
    /// The rank that dies at `--die-at`.
    #[arg(long, default_value_t = 0)]
    die_rank: usize,
    /// Rank 0 writes the final weights here.
    #[arg(long)]
    out: Option<PathBuf>,
}

/// A deterministic pseudo-random f32 in [-1, 1) from a seed.
fn rand(seed: u64) -> f32 {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ 0xD1B5_4A32_D192_ED03;
    x ^= x >> 33;
    x = x.wrapping_mul(0xFF51_AFD7_ED55_8CCD);
    x ^= x >> 33;
    ((x >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
}

fn true_w(o: usize, i: usize) -> f32 {
    rand(1_000_000 + (o * IN + i) as u64)
}

/// This rank's gradient of the squared error at step `step`.
fn gradient(w: &[f32], step: u64, rank: usize) -> Vec<f32> {
    let mut g = vec![0f32; OUT * IN];
    for b in 0..BATCH {
        let base = (step * 1_000 + rank as u64 * 100 + b as u64) * IN as u64;
        let x: Vec<f32> = (0..IN).map(|i| rand(base + i as u64)).collect();
        for o in 0..OUT {
            let target: f32 = (0..IN).map(|i| true_w(o, i) * x[i]).sum();
            let pred: f32 = (0..IN).map(|i| w[o * IN + i] * x[i]).sum();
            let err = pred - target;
            for i in 0..IN {
                g[o * IN + i] += 2.0 * err * x[i] / BATCH as f32;
            }
        }
    }
    g
}

fn to_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|f| f.to_le_bytes()).collect()
}

fn from_bytes(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

async fn train(coord: Arc<MpiCoordinator>, args: &Args) -> Result<(), String> {
    let rank = coord.rank();
    let world = coord.world_size();
    let Args {
        root,
        steps,
        every,
        die_at,
        die_rank,
        ..
    } = args;
    let (steps, every, die_at, die_rank) = (*steps, *every, *die_at, *die_rank);
    let timeout = Duration::from_secs(30);
    let opts = ckpt_core::CheckpointerOptions {
        collective_timeout: timeout,
        retention: ckpt_core::Retention::keep_last(2),
        ..Default::default()
    };
    let url = format!("file://{root}");
    let cp = ckpt_formats::builder(&url)
        .options(opts)
        .coordinator(coord.clone())
        .build()
        .await
        .map_err(|e| e.to_string())?;

    let mut w = vec![0f32; OUT * IN];
    let mut start = 0;
    if let Some(loaded) = cp.load_latest().await.map_err(|e| e.to_string())? {
        let t = loaded
            .state
            .tensor("model.w")
            .ok_or("checkpoint without model.w")?;
        w = from_bytes(&t.data);
        start = loaded.id.step;
        let cursor = loaded
            .state
            .tensor(&format!("data.cursor.rank{rank}"))
            .map(|t| from_bytes(&t.data)[0] as u64);
        if cursor != Some(start) {
            return Err(format!(
                "rank {rank}: data cursor {cursor:?} does not match step {start}"
            ));
        }
        println!("rank {rank} resumed from step {start}");
    }
    for step in start..steps {
        if die_at == Some(step) && rank == die_rank {
            eprintln!("rank {rank} dies at step {step}");
            std::process::abort();
        }
        let g = gradient(&w, step, rank);
        let all = coord
            .all_gather(to_bytes(&g), timeout)
            .await
            .map_err(|e| e.to_string())?;
        let mut avg = vec![0f32; OUT * IN];
        for part in &all {
            for (a, x) in avg.iter_mut().zip(from_bytes(part)) {
                *a += x;
            }
        }
        for (wi, a) in w.iter_mut().zip(avg) {
            *wi -= 0.05 * a / world as f32;
        }
        let done = step + 1;
        if done % every == 0 {
            let state = State::new()
                .with_tensor(
                    Tensor::new(
                        "model.w",
                        DType::F32,
                        vec![OUT as u64, IN as u64],
                        to_bytes(&w),
                    )
                    .map_err(|e| e.to_string())?,
                )
                .with_tensor(
                    Tensor::new(
                        format!("data.cursor.rank{rank}"),
                        DType::F32,
                        vec![1],
                        to_bytes(&[done as f32]),
                    )
                    .map_err(|e| e.to_string())?,
                )
                .with_meta(Value::map([
                    ("step", Value::Int(done as i64)),
                    ("world", Value::Int(world as i64)),
                ]));
            cp.save(done, state)
                .await
                .map_err(|e| e.to_string())?
                .wait()
                .await
                .map_err(|e| e.to_string())?;
        }
    }
    if rank == 0 {
        if let Some(out) = &args.out {
            std::fs::write(out, to_bytes(&w)).map_err(|e| e.to_string())?;
        }
        let loss: f32 = w
            .iter()
            .enumerate()
            .map(|(k, x)| (x - true_w(k / IN, k % IN)).powi(2))
            .sum();
        println!("finished {steps} steps on {world} ranks, distance to the true weights {loss:.4}");
    }
    Ok(())
}

fn main() {
    let args = Args::parse();
    let coord = MpiCoordinator::init().expect("MPI init");
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let r = rt.block_on(train(coord.clone(), &args));
    drop(rt);
    match r {
        Ok(()) => coord.finalize(),
        Err(e) => {
            eprintln!("rank {}: error: {e}", coord.rank());
            std::process::exit(3);
        }
    }
}
