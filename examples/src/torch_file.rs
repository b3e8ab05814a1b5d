//! The training loop's state through libtorch's own serializer instead of ckpt:
//! `Tensor::save_multi` and `Tensor::load_multi`, the C++ API's `torch::save` and
//! `torch::load` (a TorchScript archive), which is what `torch.save` and
//! `torch.load` of a state dict are to a Rust loop. The fault campaign measures a
//! restart through it beside a restart through ckpt.
//!
//! The file holds the same tensors as a ckpt checkpoint of the loop
//! ([`Trainer::capture`]), under the same names: the model's variables
//! (`model/<variable>`, the frozen ones included) and the optimizer's moments
//! (`optim/m/<parameter>`, `optim/v/<parameter>`; [`Adam`] keeps them in tensors we
//! can reach, as tch's own optimizers do not). What ckpt keeps as plain meta, the
//! step, the seed and Adam's step count, goes in as 0-d int64 tensors
//! ([`STEP`], [`SEED`], [`ADAM_T`]); Adam's hyper-parameters are constants of the
//! loop and are not written. Neither side holds RNG state: tch does not expose
//! torch's generators, so the loop reseeds them from `(seed, step)` every step.
//!
//! [`Adam`]: ckpt_core::torch::Adam

use std::collections::HashMap;
use std::path::Path;

use ckpt_core::torch::tch::{self, Tensor};
use ckpt_core::{Error, Result};

use crate::tch_loop::Trainer;

/// The step the state was saved at.
pub const STEP: &str = "meta/step";
/// The run's seed.
pub const SEED: &str = "meta/seed";
/// Adam's step count.
pub const ADAM_T: &str = "meta/optim_t";

fn tch_err(what: &str, e: tch::TchError) -> Error {
    Error::Internal(format!("libtorch failed to {what}: {e}"))
}

/// What [`save`] wrote.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Written {
    /// Tensors in the file.
    pub tensors: usize,
    /// Bytes of the file.
    pub bytes: u64,
}

/// The variables and the optimizer's moments, by name: shallow clones of the
/// live tensors (copying into them restores).
fn live(tr: &Trainer) -> Vec<(String, Tensor)> {
    let mut vars: Vec<(String, Tensor)> = tr.vs.variables().into_iter().collect();
    vars.sort_by(|a, b| a.0.cmp(&b.0));
    let mut out: Vec<(String, Tensor)> = vars
        .into_iter()
        .map(|(name, t)| (format!("model/{name}"), t))
        .collect();
    out.extend(tr.opt.named_state("optim/"));
    out
}

/// The named tensors of the state at `step`.
pub fn tensors(tr: &Trainer, step: u64) -> Vec<(String, Tensor)> {
    let mut out = live(tr);
    out.push((STEP.into(), Tensor::from(step as i64)));
    out.push((SEED.into(), Tensor::from(tr.seed() as i64)));
    out.push((ADAM_T.into(), Tensor::from(tr.opt.steps())));
    out
}

/// Write the state at `step` to `path` with `Tensor::save_multi`, then fsync the
/// file and its directory (the durability a checkpoint has once committed).
pub fn save(tr: &Trainer, step: u64, path: &Path) -> Result<Written> {
    let named = tensors(tr, step);
    Tensor::save_multi(&named, path).map_err(|e| tch_err("save the state", e))?;
    let f = std::fs::File::open(path)?;
    f.sync_all()?;
    let bytes = f.metadata()?.len();
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::File::open(dir)?.sync_all()?;
    }
    Ok(Written {
        tensors: named.len(),
        bytes,
    })
}

/// Read every tensor of `path` with `Tensor::load_multi` (onto the devices they
/// were saved from).
pub fn load(path: &Path) -> Result<Vec<(String, Tensor)>> {
    Tensor::load_multi(path).map_err(|e| tch_err(&format!("load {}", path.display()), e))
}

fn scalar(by_name: &HashMap<String, Tensor>, name: &str) -> Result<i64> {
    let t = by_name.get(name).ok_or_else(|| Error::NotFound {
        what: format!("tensor `{name}` in the torch file"),
    })?;
    t.f_int64_value(&[])
        .map_err(|e| tch_err(&format!("read `{name}`"), e))
}

/// Copy what [`load`] read into the trainer's variables and optimizer; returns
/// the step. Strict, as ckpt's restore is: every tensor must be there with the
/// live tensor's dtype and shape, nothing else may be, and nothing is written
/// unless all match. A file of a run with another seed is refused.
pub fn restore(tr: &mut Trainer, loaded: Vec<(String, Tensor)>) -> Result<u64> {
    let mut by_name: HashMap<String, Tensor> = loaded.into_iter().collect();
    if scalar(&by_name, SEED)? != tr.seed() as i64 {
        return Err(Error::InvalidInput(
            "the torch file belongs to a run with another seed".into(),
        ));
    }
    let step = u64::try_from(scalar(&by_name, STEP)?)
        .map_err(|_| Error::InvalidInput("the torch file has a negative step".into()))?;
    let t = scalar(&by_name, ADAM_T)?;
    for name in [SEED, STEP, ADAM_T] {
        by_name.remove(name);
    }
    let live = live(tr);
    let mut pairs = Vec::with_capacity(live.len());
    for (name, dst) in live {
        let src = by_name.remove(&name).ok_or_else(|| Error::NotFound {
            what: format!("tensor `{name}` in the torch file"),
        })?;
        if src.kind() != dst.kind() || src.size() != dst.size() {
            return Err(Error::InvalidInput(format!(
                "tensor `{name}`: the torch file has {:?} {:?}, the live tensor is {:?} {:?}",
                src.kind(),
                src.size(),
                dst.kind(),
                dst.size()
            )));
        }
        pairs.push((name, dst, src));
    }
    if let Some(extra) = by_name.keys().next() {
        return Err(Error::InvalidInput(format!(
            "the torch file has tensor `{extra}` that the loop does not"
        )));
    }
    for (name, mut dst, src) in pairs {
        tch::no_grad(|| dst.f_copy_(&src))
            .map_err(|e| tch_err(&format!("copy `{name}` into place"), e))?;
    }
    tr.opt.set_steps(t);
    Ok(step)
}

#[cfg(test)]
mod tests {
    use ckpt_core::torch::tch::Device;

    use super::*;
    use crate::tch_loop::{Plain, TrainConfig};

    fn config(seed: u64) -> TrainConfig {
        TrainConfig {
            root: String::new(),
            steps: 0,
            every: 1,
            seed,
            device: Device::Cpu,
            lazy: false,
            keep: 1,
            out: None,
        }
    }

    fn train(tr: &mut Trainer, from: u64, to: u64) {
        for step in from..to {
            let _ = tr.backward(step);
            tr.apply().unwrap();
        }
    }

    #[test]
    fn a_restore_from_the_torch_file_resumes_bitwise() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("state.pt");
        let mut tr = Trainer::new(&config(5), &mut Plain).unwrap();
        train(&mut tr, 0, 4);
        let w = save(&tr, 4, &path).unwrap();
        // Variables, two moments per trainable one, three scalars.
        let vars = tr.vs.variables().len();
        assert_eq!(w.tensors, 3 * vars + 3);
        assert!(w.bytes > 0);
        train(&mut tr, 4, 8);
        let straight = crate::weights::dump(&tr.vs);

        let mut fresh = Trainer::new(&config(5), &mut Plain).unwrap();
        assert_eq!(restore(&mut fresh, load(&path).unwrap()).unwrap(), 4);
        assert_eq!(fresh.opt.steps(), 4);
        train(&mut fresh, 4, 8);
        assert_eq!(crate::weights::dump(&fresh.vs), straight);

        let mut other = Trainer::new(&config(6), &mut Plain).unwrap();
        let err = restore(&mut other, load(&path).unwrap()).unwrap_err();
        assert!(matches!(err, Error::InvalidInput(_)), "{err}");
        let mut missing = load(&path).unwrap();
        missing.retain(|(n, _)| !n.starts_with("optim/v/"));
        let err = restore(&mut fresh, missing).unwrap_err();
        assert!(matches!(err, Error::NotFound { .. }), "{err}");
    }
}
