//! A data-parallel + sharded checkpointing job for the MPI tests, run under `mpirun`.
//!
//! ```text
//! mpi_ckpt save URL STEP [--abort-rank R] [--absent-rank R] [--enospc-rank R] [--timeout-s S]
//! mpi_ckpt load URL [--step S]
//! ```
//!
//! Every tensor's content is a pure function of (step, name, global index), so a
//! job of any size can check what a job of any other size saved, bitwise.
//! Each rank prints one JSON line, a [`RankReport`]: what it saved (or why its
//! save failed), or what it loaded and verified.

use std::sync::Arc;
use std::time::Duration;

use clap::{Parser, Subcommand};

use ckpt_core::coord::MpiCoordinator;
use ckpt_core::testing::report::{print_line, RankReport};
use ckpt_core::{CheckpointerOptions, Coordinator, DType, ShardSpec, State, Tensor, Value};

/// Rows of the sharded embedding (split on dimension 0) and columns of the
/// second sharded tensor (split on dimension 1): divisible by 1, 2, 3, 4.
const EMB: [u64; 2] = [24, 16];
const BLOCKS: [u64; 2] = [6, 48];
const REPLICATED: usize = 8;

fn value(step: u64, name: &str, index: u64) -> [u8; 4] {
    let mut h = blake3::Hasher::new();
    h.update(&step.to_le_bytes());
    h.update(name.as_bytes());
    h.update(&index.to_le_bytes());
    let b = h.finalize();
    let mut out = [0u8; 4];
    out.copy_from_slice(&b.as_bytes()[..4]);
    out
}

/// The bytes of the box (`off`, `shape`) of a global F32 tensor.
fn fill(step: u64, name: &str, global: &[u64], off: &[u64], shape: &[u64]) -> Vec<u8> {
    let n: u64 = shape.iter().product();
    let mut out = Vec::with_capacity(n as usize * 4);
    let mut idx = vec![0u64; shape.len()];
    for _ in 0..n {
        let mut lin = 0;
        for d in 0..shape.len() {
            lin = lin * global[d] + off[d] + idx[d];
        }
        out.extend_from_slice(&value(step, name, lin));
        for d in (0..shape.len()).rev() {
            idx[d] += 1;
            if idx[d] < shape[d] {
                break;
            }
            idx[d] = 0;
        }
    }
    out
}

/// Rank `r` of `n`'s piece of a global shape split evenly on dimension `dim`.
fn split(global: &[u64], dim: usize, r: usize, n: usize) -> (Vec<u64>, Vec<u64>) {
    let per = global[dim] / n as u64;
    let mut off = vec![0; global.len()];
    let mut shape = global.to_vec();
    off[dim] = per * r as u64;
    shape[dim] = per;
    (off, shape)
}

fn replicated_name(k: usize) -> String {
    format!("dense.{k}.weight")
}

fn replicated_len(k: usize) -> u64 {
    (k as u64 + 1) * 3000
}

fn state(step: u64, rank: usize, world: usize) -> State {
    let mut s = State::new().with_meta(Value::map([
        ("step", Value::Int(step as i64)),
        ("world", Value::Int(world as i64)),
    ]));
    for (name, global, dim) in [("emb", EMB, 0usize), ("blocks", BLOCKS, 1)] {
        let (off, shape) = split(&global, dim, rank, world);
        let t = Tensor::new(
            name,
            DType::F32,
            shape.clone(),
            fill(step, name, &global, &off, &shape),
        )
        .and_then(|t| {
            t.with_shard(ShardSpec {
                global_shape: global.to_vec(),
                offsets: off,
            })
        })
        .expect("valid shard");
        s = s.with_tensor(t);
    }
    for k in 0..REPLICATED {
        let name = replicated_name(k);
        let n = replicated_len(k);
        s = s.with_tensor(
            Tensor::new(
                name.clone(),
                DType::F32,
                vec![n],
                fill(step, &name, &[n], &[0], &[n]),
            )
            .expect("valid"),
        );
    }
    let local = format!("rng.rank{rank}");
    s.with_tensor(
        Tensor::new(
            local.clone(),
            DType::F32,
            vec![64],
            fill(step, &local, &[64], &[0], &[64]),
        )
        .expect("valid"),
    )
}

#[derive(Parser, Debug)]
#[command(
    name = "mpi_ckpt",
    about = "The MPI test job: save or load a sharded checkpoint"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Save the state of `step` with every rank.
    Save {
        /// Checkpoint root URL.
        url: String,
        /// The step to save.
        step: u64,
        #[command(flatten)]
        faults: SaveFaults,
        /// Collective timeout, seconds.
        #[arg(long)]
        timeout_s: Option<u64>,
    },
    /// Load the newest checkpoint (or `--step`) and verify this rank's share.
    Load {
        /// Checkpoint root URL.
        url: String,
        /// Load this step instead of the newest.
        #[arg(long)]
        step: Option<u64>,
    },
}

/// The failure of one rank during a save.
#[derive(clap::Args, Debug)]
struct SaveFaults {
    /// This rank dies (abort) after its third object is durable.
    #[arg(long)]
    abort_rank: Option<usize>,
    /// This rank never takes part in the save.
    #[arg(long)]
    absent_rank: Option<usize>,
    /// This rank's store fails with ENOSPC.
    #[arg(long)]
    enospc_rank: Option<usize>,
    /// This rank saves metadata of its own (another value than rank 0's).
    #[arg(long)]
    own_meta_rank: Option<usize>,
}

async fn save(
    coord: Arc<MpiCoordinator>,
    url: &str,
    step: u64,
    faults: &SaveFaults,
    timeout_s: Option<u64>,
) -> Result<(), String> {
    let rank = coord.rank();
    let world = coord.world_size();
    let mut opts = CheckpointerOptions::default();
    opts.write.chunk_size = 4096;
    if let Some(s) = timeout_s {
        opts.collective_timeout = Duration::from_secs(s);
    }
    let cp = ckpt_formats::builder(url)
        .options(opts)
        .coordinator(coord.clone())
        .build()
        .await
        .map_err(|e| e.to_string())?;
    if faults.abort_rank == Some(rank) {
        // Die after this rank's third object is durable: mid-save, no clean-up.
        ckpt_core::failpoint::set("save.mid_data", "3*abort");
    }
    if faults.absent_rank == Some(rank) {
        // This rank never takes part in the save; the others must not hang.
        std::thread::sleep(Duration::from_secs(30));
        return Err("absent rank".into());
    }
    if faults.enospc_rank == Some(rank) {
        // This rank's disk is full: its share fails as a local store fails with ENOSPC.
        ckpt_core::failpoint::set("save.before_data", "enospc");
    }
    let mut st = state(step, rank, world);
    if faults.own_meta_rank == Some(rank) {
        st = st.with_meta(Value::map([
            ("step", Value::Int(step as i64)),
            ("world", Value::Int(world as i64)),
            ("rank", Value::Int(rank as i64)),
        ]));
    }
    let r = match cp.save(step, st).await {
        Ok(h) => h.wait().await,
        Err(e) => Err(e),
    };
    let r = match r {
        Ok(r) => r,
        Err(e) => {
            // Which error this rank got, as data: every rank must report the same kind.
            let kind = match &e {
                ckpt_core::Error::Storage(_) => "storage",
                ckpt_core::Error::Timeout(_) => "timeout",
                ckpt_core::Error::Stragglers { .. } => "stragglers",
                ckpt_core::Error::Internal(_) => "internal",
                ckpt_core::Error::InvalidInput(_) => "invalid",
                _ => "other",
            };
            print_line(&RankReport::SaveFailed {
                rank,
                error: kind.to_owned(),
                errno: e.os_errno(),
            });
            if faults.enospc_rank.is_some() || faults.own_meta_rank.is_some() {
                // The save failed in order on every rank: let every rank report
                // before any exits (mpirun ends the job at the first exit).
                use ckpt_core::Coordinator;
                let _ = coord.all_gather(Vec::new(), Duration::from_secs(20)).await;
            }
            return Err(e.to_string());
        }
    };
    print_line(&RankReport::Saved {
        rank,
        world,
        raw_bytes: r.raw_bytes,
        stored_bytes: r.stored_bytes,
        committed: r.id.to_string(),
    });
    Ok(())
}

async fn load(coord: Arc<MpiCoordinator>, url: &str, step: Option<u64>) -> Result<(), String> {
    let rank = coord.rank();
    let world = coord.world_size();
    let cp = ckpt_formats::builder(url)
        .coordinator(coord.clone())
        .build()
        .await
        .map_err(|e| e.to_string())?;
    let id = match step {
        Some(step) => cp
            .committed()
            .await
            .map_err(|e| e.to_string())?
            .into_iter()
            .find(|i| i.step == step)
            .ok_or("no such step")?,
        None => {
            cp.load_latest()
                .await
                .map_err(|e| e.to_string())?
                .ok_or("no checkpoint")?
                .id
        }
    };
    let step = id.step;
    let manifest = cp.manifest(&id).await.map_err(|e| e.to_string())?;
    let saved_world = manifest.world_size as usize;
    // This rank's pieces in this job's split (M = world), whatever split saved them.
    let mut wanted = Vec::new();
    for (name, global, dim) in [("emb", EMB, 0usize), ("blocks", BLOCKS, 1)] {
        let (off, shape) = split(&global, dim, rank, world);
        wanted.push((
            name,
            shape,
            ShardSpec {
                global_shape: global.to_vec(),
                offsets: off,
            },
        ));
    }
    let pieces = cp
        .load_shards(&id, &wanted)
        .await
        .map_err(|e| e.to_string())?;
    for ((name, shape, spec), t) in wanted.iter().zip(&pieces) {
        let global = spec.global_shape.clone();
        if t.data[..] != fill(step, name, &global, &spec.offsets, shape)[..] {
            return Err(format!("rank {rank}: piece of `{name}` differs"));
        }
    }
    let names: Vec<String> = (0..REPLICATED)
        .map(replicated_name)
        .chain((0..saved_world).map(|r| format!("rng.rank{r}")))
        .collect();
    let refs: Vec<&str> = names.iter().map(String::as_str).collect();
    let plain = cp
        .load_tensors(&id, &refs)
        .await
        .map_err(|e| e.to_string())?;
    for t in &plain {
        let n = t.shape[0];
        if t.data[..] != fill(step, &t.name, &[n], &[0], &[n])[..] {
            return Err(format!("rank {rank}: `{}` differs", t.name));
        }
    }
    print_line(&RankReport::Loaded {
        rank,
        world,
        loaded_step: step,
        saved_world,
    });
    Ok(())
}

fn main() {
    let cli = Cli::parse();
    let coord = MpiCoordinator::init().expect("MPI init");
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let result = rt.block_on(async {
        match &cli.cmd {
            Cmd::Save {
                url,
                step,
                faults,
                timeout_s,
            } => save(coord.clone(), url, *step, faults, *timeout_s).await,
            Cmd::Load { url, step } => load(coord.clone(), url, *step).await,
        }
    });
    drop(rt);
    match result {
        Ok(()) => coord.finalize(),
        Err(e) => {
            eprintln!("rank {}: error: {e}", coord.rank());
            // A failed collective cannot be finalised cleanly: leave at once.
            std::process::exit(3);
        }
    }
}
