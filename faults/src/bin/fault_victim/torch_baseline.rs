//! `--torch-baseline save|restore`: the restart the campaign compares ckpt's with.
//! The same model, optimizer and steps as the victim's loop, but the state goes
//! through libtorch's own serializer (`ckpt_examples::torch_file`: the tensors a
//! ckpt checkpoint of the loop holds, written with `Tensor::save_multi` and read
//! with `Tensor::load_multi`) and ckpt is not used at all.

use std::path::Path;
use std::time::Instant;

use ckpt_core::Result;
use ckpt_examples::tch_loop::{Hooks, TrainConfig, Trainer};
use ckpt_examples::torch_file;
use ckpt_faults::event::Event;

use super::Victim;

fn ms(t: Instant) -> f64 {
    t.elapsed().as_secs_f64() * 1e3
}

/// Take the step after `step` and print it as the loop does.
fn one_step(tr: &mut Trainer, step: u64) -> Result<()> {
    let loss = tr.backward(step);
    tr.apply()?;
    println!("step {} loss {:.6}", step + 1, loss.double_value(&[]));
    Ok(())
}

/// Train from scratch to `cfg.steps`, write the state to `path` (fsynced) and
/// report it; then take one more step, whose loss line a restore must repeat.
pub fn save(cfg: &TrainConfig, victim: &mut Victim, path: &Path) -> Result<()> {
    let mut tr = Trainer::new(cfg, victim)?;
    for step in 0..cfg.steps {
        let _ = tr.backward(step);
        tr.apply()?;
    }
    let t = Instant::now();
    let w = torch_file::save(&tr, cfg.steps, path)?;
    victim.report(Event::TorchSave {
        step: cfg.steps,
        tensors: w.tensors,
        bytes: w.bytes,
        save_ms: ms(t),
    });
    one_step(&mut tr, cfg.steps)
}

/// A restart through libtorch's serializer: build the model, read `path`, put its
/// state in place, report the load, take one step (reported as the loop's first
/// step) and stop.
pub fn restore(cfg: &TrainConfig, victim: &mut Victim, path: &Path) -> Result<()> {
    let mut tr = Trainer::new(cfg, victim)?;
    let t = Instant::now();
    let loaded = torch_file::load(path)?;
    let load_ms = ms(t);
    let step = torch_file::restore(&mut tr, loaded)?;
    victim.report(Event::TorchLoad {
        pid: std::process::id(),
        step,
        load_ms,
        since_exec_ms: ms(victim.t0),
    });
    println!("resumed from step {step}");
    one_step(&mut tr, step)?;
    victim.stepped(step + 1);
    Ok(())
}
