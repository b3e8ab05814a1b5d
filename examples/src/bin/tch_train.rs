//! Train a small MLP with tch, checkpointing every `--every` steps, and resume from
//! the newest checkpoint when restarted.
//!
//! ```text
//! tch_train --root DIR [--steps 60] [--every 5] [--seed 1] [--device cpu|cuda]
//!           [--eager] [--keep 2] [--out WEIGHTS]
//! ```

use std::path::PathBuf;

use clap::Parser;

use ckpt_core::torch::tch::Device;
use ckpt_examples::tch_loop::{parse_device, train, TrainConfig};

/// Train a small MLP with tch, checkpointing and resuming.
#[derive(Parser, Debug)]
#[command(name = "tch_train")]
struct Args {
    /// Checkpoint root (a directory or a URL).
    #[arg(long)]
    root: String,
    /// Train until this many steps are done.
    #[arg(long, default_value_t = 60)]
    steps: u64,
    /// Checkpoint every this many steps.
    #[arg(long, default_value_t = 5)]
    every: u64,
    /// The run's seed.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// `cpu` or `cuda`.
    #[arg(long, default_value = "cpu", value_parser = parse_device)]
    device: Device,
    /// Eager snapshots (the default is lazy).
    #[arg(long)]
    eager: bool,
    /// Checkpoints to keep.
    #[arg(long, default_value_t = 2)]
    keep: usize,
    /// Where to write the final weights.
    #[arg(long)]
    out: Option<PathBuf>,
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let a = Args::parse();
    let cfg = TrainConfig {
        root: a.root,
        steps: a.steps,
        every: a.every,
        seed: a.seed,
        device: a.device,
        lazy: !a.eager,
        keep: a.keep,
        out: a.out,
    };
    if let Err(e) = train(&cfg).await {
        eprintln!("tch_train: {e}");
        std::process::exit(1);
    }
}
