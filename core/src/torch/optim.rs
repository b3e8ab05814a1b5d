//! Adam, implemented on tch tensors so that its state can be checkpointed.
//!
//! tch's `nn::Optimizer` wraps libtorch's C++ optimizers and exposes neither their
//! moment buffers nor their step counts, so a loop using it cannot resume bitwise
//! identically. This optimizer owns its state (`m`, `v`, the step count `t`), which
//! [`Adam::capture`] saves and [`Adam::restore`] puts back.

use tch::Tensor;

use super::capture::TorchCapture;
use super::restore::copy_into;
use super::tch_err;
use crate::error::{Error, Result};
use crate::model::state::State;
use crate::model::value::Value;

/// Hyper-parameters of [`Adam`] (PyTorch's defaults).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamConfig {
    /// Learning rate.
    pub lr: f64,
    /// Decay of the first moment.
    pub beta1: f64,
    /// Decay of the second moment.
    pub beta2: f64,
    /// Added to the denominator.
    pub eps: f64,
    /// L2 penalty added to the gradient (classic Adam, not AdamW).
    pub weight_decay: f64,
}

impl Default for AdamConfig {
    fn default() -> Self {
        AdamConfig {
            lr: 1e-3,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.0,
        }
    }
}

/// Adam over the trainable variables of a `VarStore`, with its state in tensors it
/// owns (on the variables' devices).
#[derive(Debug)]
pub struct Adam {
    cfg: AdamConfig,
    t: i64,
    params: Vec<(String, Tensor)>,
    m: Vec<Tensor>,
    v: Vec<Tensor>,
}

impl Adam {
    /// Adam over every trainable variable of `vs`, with zeroed moments.
    pub fn new(vs: &tch::nn::VarStore, cfg: AdamConfig) -> Result<Self> {
        let mut params: Vec<(String, Tensor)> = vs
            .variables()
            .into_iter()
            .filter(|(_, t)| t.requires_grad())
            .collect();
        params.sort_by(|a, b| a.0.cmp(&b.0));
        let zeros = |p: &Tensor| {
            p.f_zeros_like()
                .map_err(|e| tch_err("allocate optimizer state", e))
        };
        let m = params
            .iter()
            .map(|(_, p)| zeros(p))
            .collect::<Result<_>>()?;
        let v = params
            .iter()
            .map(|(_, p)| zeros(p))
            .collect::<Result<_>>()?;
        Ok(Adam {
            cfg,
            t: 0,
            params,
            m,
            v,
        })
    }

    /// The hyper-parameters.
    pub fn config(&self) -> AdamConfig {
        self.cfg
    }

    /// Optimizer steps taken so far.
    pub fn steps(&self) -> i64 {
        self.t
    }

    /// Set the step count, for a restore of the moments through another serializer
    /// (see [`Adam::named_state`]); [`Adam::restore`] sets it by itself.
    pub fn set_steps(&mut self, t: i64) {
        self.t = t;
    }

    /// The moment tensors under the names [`Adam::capture`] gives them
    /// (`prefix + "m/" + name`, `prefix + "v/" + name`), as shallow clones: they
    /// share storage with the optimizer's own, so copying into them restores it.
    /// For writing the state with another serializer (libtorch's
    /// `Tensor::save_multi`); the rest of the state is [`Adam::steps`] and
    /// [`Adam::config`].
    pub fn named_state(&self, prefix: &str) -> Vec<(String, Tensor)> {
        let mut out = Vec::with_capacity(2 * self.params.len());
        for ((name, _), (m, v)) in self.params.iter().zip(self.m.iter().zip(self.v.iter())) {
            out.push((format!("{prefix}m/{name}"), m.shallow_clone()));
            out.push((format!("{prefix}v/{name}"), v.shallow_clone()));
        }
        out
    }

    /// Clear the gradients of every parameter.
    pub fn zero_grad(&mut self) {
        for (_, p) in &mut self.params {
            p.zero_grad();
        }
    }

    /// One Adam update of every parameter that has a gradient.
    pub fn step(&mut self) -> Result<()> {
        let c = self.cfg;
        self.t += 1;
        let bc1 = 1.0 - c.beta1.powi(self.t as i32);
        let bc2 = 1.0 - c.beta2.powi(self.t as i32);
        let step_size = c.lr / bc1;
        let bc2_sqrt = bc2.sqrt();
        tch::no_grad(|| -> std::result::Result<(), tch::TchError> {
            for ((_, p), (m, v)) in self
                .params
                .iter_mut()
                .zip(self.m.iter_mut().zip(self.v.iter_mut()))
            {
                let g = p.f_grad()?;
                if !g.defined() {
                    continue;
                }
                let g = if c.weight_decay != 0.0 {
                    g.f_add(&p.f_mul_scalar(c.weight_decay)?)?
                } else {
                    g
                };
                let _ = m.f_mul_scalar_(c.beta1)?;
                let _ = m.f_add_(&g.f_mul_scalar(1.0 - c.beta1)?)?;
                let _ = v.f_mul_scalar_(c.beta2)?;
                let _ = v.f_add_(&g.f_mul(&g)?.f_mul_scalar(1.0 - c.beta2)?)?;
                let denom = v.f_sqrt()?.f_div_scalar(bc2_sqrt)?.f_add_scalar(c.eps)?;
                let _ = p.f_sub_(&m.f_div(&denom)?.f_mul_scalar(step_size)?)?;
            }
            Ok(())
        })
        .map_err(|e| tch_err("apply an Adam step", e))
    }

    /// Add the optimizer's state to a capture: tensors `prefix + "m/" + name` and
    /// `prefix + "v/" + name`, and a meta entry `prefix` with the step count and the
    /// hyper-parameters.
    pub fn capture(&self, prefix: &str, cap: &mut TorchCapture) -> Result<()> {
        for ((name, _), (m, v)) in self.params.iter().zip(self.m.iter().zip(self.v.iter())) {
            cap.tensor(format!("{prefix}m/{name}"), m)?;
            cap.tensor(format!("{prefix}v/{name}"), v)?;
        }
        let c = self.cfg;
        cap.meta(
            prefix,
            Value::map([
                ("kind", Value::Str("adam".into())),
                ("t", Value::Int(self.t)),
                ("lr", Value::Float(c.lr)),
                ("beta1", Value::Float(c.beta1)),
                ("beta2", Value::Float(c.beta2)),
                ("eps", Value::Float(c.eps)),
                ("weight_decay", Value::Float(c.weight_decay)),
                ("params", Value::Int(self.params.len() as i64)),
            ]),
        );
        Ok(())
    }

    /// Put back the state captured under `prefix` (moments, step count and
    /// hyper-parameters). The parameters must be the same, by name, dtype and shape.
    pub fn restore(&mut self, prefix: &str, state: &State) -> Result<()> {
        let meta = state.meta.get(prefix).ok_or_else(|| Error::NotFound {
            what: format!("optimizer state `{prefix}` in the checkpoint's meta"),
        })?;
        let bad = |what: &str| Error::InvalidInput(format!("optimizer state `{prefix}`: {what}"));
        if meta.get("kind") != Some(&Value::Str("adam".into())) {
            return Err(bad("not an Adam state"));
        }
        let float = |k: &str| match meta.get(k) {
            Some(Value::Float(f)) => Ok(*f),
            _ => Err(bad(&format!("`{k}` missing or not a float"))),
        };
        let t = meta
            .get("t")
            .and_then(Value::as_int)
            .filter(|t| *t >= 0)
            .ok_or_else(|| bad("`t` missing or negative"))?;
        let n = meta.get("params").and_then(Value::as_int);
        if n != Some(self.params.len() as i64) {
            return Err(bad(&format!(
                "saved for {n:?} parameters, this optimizer has {}",
                self.params.len()
            )));
        }
        let cfg = AdamConfig {
            lr: float("lr")?,
            beta1: float("beta1")?,
            beta2: float("beta2")?,
            eps: float("eps")?,
            weight_decay: float("weight_decay")?,
        };
        let find = |key: String| {
            state.tensor(&key).ok_or_else(|| Error::NotFound {
                what: format!("optimizer tensor `{key}` in the checkpoint"),
            })
        };
        // Look everything up before writing anything.
        let mut srcs = Vec::with_capacity(self.params.len());
        for (name, _) in &self.params {
            srcs.push((
                find(format!("{prefix}m/{name}"))?,
                find(format!("{prefix}v/{name}"))?,
            ));
        }
        for ((m, v), (sm, sv)) in self.m.iter_mut().zip(self.v.iter_mut()).zip(srcs) {
            copy_into(m, sm)?;
            copy_into(v, sv)?;
        }
        self.cfg = cfg;
        self.t = t;
        Ok(())
    }
}
