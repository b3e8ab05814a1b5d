//! Restore checkpointed tensors into `tch`: into live tensors (keeping their device
//! and dtype), into a whole `VarStore`, or as new tensors on a chosen device.

use tch::{Device, Tensor};

use super::kind::{dtype_of, kind_of, shape_i64, shape_of};
use super::tch_err;
use crate::error::{Error, Result};
use crate::model::state::State;
use crate::model::tensor::Tensor as CkptTensor;

/// A new tch tensor on `device` with the checkpointed tensor's dtype, shape and bytes.
pub fn to_tch(t: &CkptTensor, device: Device) -> Result<Tensor> {
    t.validate()?;
    let kind = kind_of(t.dtype)?;
    let shape = shape_i64(&t.shape)?;
    let cpu = Tensor::f_from_data_size(&t.data, &shape, kind)
        .map_err(|e| tch_err(&format!("build tensor `{}`", t.name), e))?;
    if device == Device::Cpu {
        return Ok(cpu);
    }
    cpu.f_to_device_(device, kind, false, false)
        .map_err(|e| tch_err(&format!("move tensor `{}` to {device:?}", t.name), e))
}

/// Copy a checkpointed tensor into a live one, which keeps its device, dtype and
/// memory (so views and optimizer references stay valid). The dtype and shape must
/// match exactly: a mismatch is an [`Error::InvalidInput`] naming the tensor.
pub fn copy_into(dst: &mut Tensor, src: &CkptTensor) -> Result<()> {
    let kind = dst
        .f_kind()
        .map_err(|e| tch_err("read a tensor's kind", e))?;
    let dtype = dtype_of(kind)?;
    if dtype != src.dtype {
        return Err(Error::InvalidInput(format!(
            "tensor `{}`: checkpoint has {}, the live tensor is {}",
            src.name, src.dtype, dtype
        )));
    }
    let shape = shape_of(dst)?;
    if shape != src.shape {
        return Err(Error::InvalidInput(format!(
            "tensor `{}`: checkpoint has shape {:?}, the live tensor {:?}",
            src.name, src.shape, shape
        )));
    }
    let cpu = to_tch(src, Device::Cpu)?;
    tch::no_grad(|| dst.f_copy_(&cpu))
        .map_err(|e| tch_err(&format!("copy tensor `{}` into place", src.name), e))
}

/// Restore every variable of a `VarStore` from `state`, where the variables were
/// captured as `prefix + name` (see `TorchCapture::var_store`).
///
/// Strict: a variable the checkpoint lacks, or a checkpoint tensor under `prefix`
/// that the store lacks, is an error, and nothing is written unless every variable
/// matches in dtype and shape. Give the model its own prefix (`"model/"`): with
/// `""` every tensor of the checkpoint counts as the store's. Returns the number
/// of variables restored.
pub fn var_store(vs: &mut tch::nn::VarStore, state: &State, prefix: &str) -> Result<usize> {
    let mut vars: Vec<(String, Tensor)> = vs.variables().into_iter().collect();
    vars.sort_by(|a, b| a.0.cmp(&b.0));
    let mut pairs = Vec::with_capacity(vars.len());
    for (name, t) in vars {
        let key = format!("{prefix}{name}");
        let src = state.tensor(&key).ok_or_else(|| Error::NotFound {
            what: format!("tensor `{key}` for variable `{name}` in the checkpoint"),
        })?;
        check_matches(&t, src)?;
        pairs.push((t, src));
    }
    let expected: std::collections::HashSet<&str> =
        pairs.iter().map(|(_, s)| s.name.as_str()).collect();
    if let Some(extra) = state
        .tensors
        .iter()
        .find(|t| t.name.starts_with(prefix) && !expected.contains(t.name.as_str()))
    {
        return Err(Error::InvalidInput(format!(
            "the checkpoint has tensor `{}` under `{prefix}` that the VarStore does not",
            extra.name
        )));
    }
    let n = pairs.len();
    for (mut t, src) in pairs {
        copy_into(&mut t, src)?;
    }
    Ok(n)
}

fn check_matches(live: &Tensor, src: &CkptTensor) -> Result<()> {
    let kind = live
        .f_kind()
        .map_err(|e| tch_err("read a tensor's kind", e))?;
    let dtype = dtype_of(kind)?;
    let shape = shape_of(live)?;
    if dtype != src.dtype || shape != src.shape {
        return Err(Error::InvalidInput(format!(
            "tensor `{}`: checkpoint has {} {:?}, the live tensor is {} {:?}",
            src.name, src.dtype, src.shape, dtype, shape
        )));
    }
    Ok(())
}
