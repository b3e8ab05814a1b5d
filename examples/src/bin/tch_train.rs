//! Train a small MLP with tch, checkpointing every `--every` steps, and resume from
//! the newest checkpoint when restarted.
//!
//! ```text
//! tch_train --root DIR [--steps 60] [--every 5] [--seed 1] [--device cpu|cuda]
//!           [--eager] [--keep 2] [--out WEIGHTS]
//! ```

use ckpt_core::torch::tch::Device;
use ckpt_examples::tch_loop::{train, TrainConfig};

fn parse() -> Result<TrainConfig, String> {
    let mut cfg = TrainConfig {
        root: String::new(),
        steps: 60,
        every: 5,
        seed: 1,
        device: Device::Cpu,
        lazy: true,
        keep: 2,
        out: None,
    };
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        if flag == "--eager" {
            cfg.lazy = false;
            continue;
        }
        let value = args.next().ok_or_else(|| format!("{flag} needs a value"))?;
        let num = |v: &str| v.parse::<u64>().map_err(|e| format!("{flag} {v}: {e}"));
        match flag.as_str() {
            "--root" => cfg.root = value,
            "--steps" => cfg.steps = num(&value)?,
            "--every" => cfg.every = num(&value)?,
            "--seed" => cfg.seed = num(&value)?,
            "--keep" => cfg.keep = num(&value)? as usize,
            "--out" => cfg.out = Some(value.into()),
            "--device" => {
                cfg.device = match value.as_str() {
                    "cpu" => Device::Cpu,
                    "cuda" => Device::Cuda(0),
                    other => return Err(format!("unknown device {other} (cpu or cuda)")),
                }
            }
            other => return Err(format!("unknown flag {other}")),
        }
    }
    if cfg.root.is_empty() {
        return Err("--root DIR is required".into());
    }
    Ok(cfg)
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let cfg = match parse() {
        Ok(c) => c,
        Err(e) => {
            eprintln!("tch_train: {e}");
            std::process::exit(2);
        }
    };
    if let Err(e) = train(&cfg).await {
        eprintln!("tch_train: {e}");
        std::process::exit(1);
    }
}
