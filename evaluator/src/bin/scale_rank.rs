//! One rank of `ckpt-eval scale`, run under `mpirun` by the scale experiment.
//!
//! ```text
//! mpirun -np N scale_rank --root DIR --mib M --tensors T --repeats R [--no-dedup]
//! ```
//!
//! Every rank holds the same data-parallel state (`M` MiB in `T` F32 tensors): a
//! replicated state, written once in total and spread over the ranks. With
//! `--no-dedup` each rank's tensors get rank-specific names, so every rank writes a
//! full copy (what a job does without deduplication). Each repeat changes every
//! chunk and saves; each rank prints one JSON line with its stall, its time until
//! the checkpoint is committed, and the bytes it wrote.

use std::time::Instant;

use ckpt_core::coord::MpiCoordinator;
use ckpt_core::{Capture, CheckpointerOptions, Coordinator};
use ckpt_eval::workload::{uniform_f32, Params};
use clap::Parser;

/// One rank of the scale experiment.
#[derive(Debug, Parser)]
struct Args {
    /// Checkpoint directory, shared by the ranks.
    #[arg(long)]
    root: String,
    /// MiB of state per rank.
    #[arg(long, default_value_t = 64)]
    mib: usize,
    /// Number of F32 tensors the state is split into.
    #[arg(long, default_value_t = 16)]
    tensors: usize,
    /// Saves measured after the warm-up save.
    #[arg(long, default_value_t = 2)]
    repeats: u64,
    /// Give each rank's tensors rank-specific names (every rank writes a full copy).
    #[arg(long)]
    no_dedup: bool,
}

async fn run(coord: std::sync::Arc<MpiCoordinator>, args: &Args) -> Result<String, String> {
    let rank = coord.rank();
    let world = coord.world_size();
    let (root, mib, tensors, repeats) = (&args.root, args.mib, args.tensors, args.repeats);
    let dedup = !args.no_dedup;
    let params = Params::from_state(&uniform_f32(tensors, mib << 20, 1));
    let chunk = CheckpointerOptions::default().write.chunk_size;
    let cp = ckpt_formats::builder(format!("file://{root}"))
        .coordinator(coord.clone())
        .build()
        .await
        .map_err(|e| e.to_string())?;
    let capture = |p: &Params| -> Capture {
        let mut c = p.capture();
        if !dedup {
            for t in &mut c.tensors {
                t.name = format!("{}.rank{rank}", t.name);
            }
        }
        c
    };
    // Warm the staging pool (the steady state of a training loop).
    cp.save(0, capture(&params))
        .await
        .map_err(|e| e.to_string())?
        .wait()
        .await
        .map_err(|e| e.to_string())?;
    let (mut stall, mut commit, mut written) = (vec![], vec![], vec![]);
    for k in 1..=repeats {
        params.touch_all(k, chunk);
        let c = capture(&params);
        let t = Instant::now();
        let h = cp.save(k, c).await.map_err(|e| e.to_string())?;
        stall.push(t.elapsed().as_secs_f64());
        let r = h.wait().await.map_err(|e| e.to_string())?;
        commit.push(t.elapsed().as_secs_f64());
        written.push(r.stored_bytes);
    }
    Ok(serde_json::json!({
        "rank": rank, "world": world, "dedup": dedup, "state_bytes": params.nbytes(),
        "stall_s": stall, "commit_s": commit, "written_bytes": written,
    })
    .to_string())
}

fn main() {
    let args = Args::parse();
    let coord = MpiCoordinator::init().expect("MPI init");
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let r = rt.block_on(run(coord.clone(), &args));
    drop(rt);
    match r {
        Ok(line) => {
            println!("{line}");
            coord.finalize();
        }
        Err(e) => {
            eprintln!("rank {}: error: {e}", coord.rank());
            std::process::exit(3);
        }
    }
}
