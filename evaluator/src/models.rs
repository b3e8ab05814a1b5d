//! Training states shaped like real models: the tensor names and shapes of
//! ResNet-50, BERT-large, GPT-2 XL and Llama-3-8B, scaled to a byte budget, with
//! Adam optimizer state and a choice of dtype mix.
//!
//! Scaling keeps the number of tensors and their rank: every dimension of a tensor
//! of rank `r` is multiplied by `f^(1/r)` (at least 1), where `f` is the target size
//! over the full model's size, so the total lands near the target while the
//! tensor count and the mix of big and small tensors stay those of the model.

use bytes::Bytes;
use ckpt_core::testing::Xorshift;
use ckpt_core::{DType, State, Tensor};
use serde::Serialize;

/// The models whose shapes are available.
pub const MODELS: &[&str] = &["resnet50", "bert-large", "gpt2-xl", "llama3-8b"];

/// How parameters and optimizer state are typed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum DtypeMix {
    /// Everything F32 (parameters, Adam moments).
    Fp32,
    /// Mixed precision: BF16 parameters, F32 master copy and Adam moments.
    Bf16,
}

impl DtypeMix {
    /// Parse `fp32` or `bf16`.
    pub fn parse(s: &str) -> Option<DtypeMix> {
        match s {
            "fp32" => Some(DtypeMix::Fp32),
            "bf16" => Some(DtypeMix::Bf16),
            _ => None,
        }
    }
}

/// What to generate.
#[derive(Debug, Clone, Serialize)]
pub struct ModelState {
    /// One of [`MODELS`].
    pub model: String,
    /// Target total bytes (parameters and optimizer state).
    pub bytes: usize,
    /// Dtype mix.
    pub mix: DtypeMix,
    /// Include Adam state (`exp_avg`, `exp_avg_sq`, and the master copy for BF16).
    pub optimizer: bool,
    /// Seed of the generated values.
    pub seed: u64,
}

/// The parameter shapes of a full-size model, in order.
pub fn shapes(model: &str) -> Option<Vec<(String, Vec<u64>)>> {
    let mut v: Vec<(String, Vec<u64>)> = Vec::new();
    let mut p = |n: String, s: &[u64]| v.push((n, s.to_vec()));
    match model {
        "resnet50" => {
            p("conv1.weight".into(), &[64, 3, 7, 7]);
            p("bn1.weight".into(), &[64]);
            p("bn1.bias".into(), &[64]);
            let mut inp = 64u64;
            for (stage, (&blocks, &width)) in [3u64, 4, 6, 3]
                .iter()
                .zip(&[64u64, 128, 256, 512])
                .enumerate()
            {
                for b in 0..blocks {
                    let pre = format!("layer{}.{b}", stage + 1);
                    p(format!("{pre}.conv1.weight"), &[width, inp, 1, 1]);
                    p(format!("{pre}.conv2.weight"), &[width, width, 3, 3]);
                    p(format!("{pre}.conv3.weight"), &[width * 4, width, 1, 1]);
                    for bn in ["bn1", "bn2", "bn3"] {
                        let c = if bn == "bn3" { width * 4 } else { width };
                        p(format!("{pre}.{bn}.weight"), &[c]);
                        p(format!("{pre}.{bn}.bias"), &[c]);
                    }
                    if b == 0 {
                        p(
                            format!("{pre}.downsample.0.weight"),
                            &[width * 4, inp, 1, 1],
                        );
                    }
                    inp = width * 4;
                }
            }
            p("fc.weight".into(), &[1000, 2048]);
            p("fc.bias".into(), &[1000]);
        }
        "bert-large" => {
            let (d, ff) = (1024u64, 4096u64);
            p("embeddings.word_embeddings.weight".into(), &[30522, d]);
            p("embeddings.position_embeddings.weight".into(), &[512, d]);
            p("embeddings.LayerNorm.weight".into(), &[d]);
            for l in 0..24 {
                let pre = format!("encoder.layer.{l}");
                for m in ["query", "key", "value", "output.dense"] {
                    p(format!("{pre}.attention.{m}.weight"), &[d, d]);
                    p(format!("{pre}.attention.{m}.bias"), &[d]);
                }
                p(format!("{pre}.intermediate.dense.weight"), &[ff, d]);
                p(format!("{pre}.intermediate.dense.bias"), &[ff]);
                p(format!("{pre}.output.dense.weight"), &[d, ff]);
                p(format!("{pre}.output.dense.bias"), &[d]);
                p(format!("{pre}.output.LayerNorm.weight"), &[d]);
            }
        }
        "gpt2-xl" => {
            let d = 1600u64;
            p("wte.weight".into(), &[50257, d]);
            p("wpe.weight".into(), &[1024, d]);
            for l in 0..48 {
                let pre = format!("h.{l}");
                p(format!("{pre}.ln_1.weight"), &[d]);
                p(format!("{pre}.attn.c_attn.weight"), &[d, 3 * d]);
                p(format!("{pre}.attn.c_attn.bias"), &[3 * d]);
                p(format!("{pre}.attn.c_proj.weight"), &[d, d]);
                p(format!("{pre}.ln_2.weight"), &[d]);
                p(format!("{pre}.mlp.c_fc.weight"), &[d, 4 * d]);
                p(format!("{pre}.mlp.c_proj.weight"), &[4 * d, d]);
            }
            p("ln_f.weight".into(), &[d]);
        }
        "llama3-8b" => {
            let (d, kv, ff) = (4096u64, 1024u64, 14336u64);
            p("model.embed_tokens.weight".into(), &[128256, d]);
            for l in 0..32 {
                let pre = format!("model.layers.{l}");
                p(format!("{pre}.self_attn.q_proj.weight"), &[d, d]);
                p(format!("{pre}.self_attn.k_proj.weight"), &[kv, d]);
                p(format!("{pre}.self_attn.v_proj.weight"), &[kv, d]);
                p(format!("{pre}.self_attn.o_proj.weight"), &[d, d]);
                p(format!("{pre}.mlp.gate_proj.weight"), &[ff, d]);
                p(format!("{pre}.mlp.up_proj.weight"), &[ff, d]);
                p(format!("{pre}.mlp.down_proj.weight"), &[d, ff]);
                p(format!("{pre}.input_layernorm.weight"), &[d]);
                p(format!("{pre}.post_attention_layernorm.weight"), &[d]);
            }
            p("model.norm.weight".into(), &[d]);
            p("lm_head.weight".into(), &[128256, d]);
        }
        _ => return None,
    }
    Some(v)
}

/// Number of elements of a shape.
pub fn numel(shape: &[u64]) -> u64 {
    shape.iter().product()
}

/// Scale a shape by a size factor (see the module docs).
pub fn scale_shape(shape: &[u64], factor: f64) -> Vec<u64> {
    let per = factor.powf(1.0 / shape.len().max(1) as f64);
    shape
        .iter()
        .map(|&d| ((d as f64 * per).round() as u64).max(1))
        .collect()
}

/// The tensors of a state: (name, dtype, shape), parameters first, then optimizer state.
fn layout(
    params: &[(String, Vec<u64>)],
    mix: DtypeMix,
    optimizer: bool,
) -> Vec<(String, DType, Vec<u64>)> {
    let pdt = match mix {
        DtypeMix::Fp32 => DType::F32,
        DtypeMix::Bf16 => DType::BF16,
    };
    let mut out: Vec<_> = params
        .iter()
        .map(|(n, s)| (format!("model.{n}"), pdt, s.clone()))
        .collect();
    if optimizer {
        for (n, s) in params {
            if mix == DtypeMix::Bf16 {
                out.push((format!("optim.{n}.master"), DType::F32, s.clone()));
            }
            out.push((format!("optim.{n}.exp_avg"), DType::F32, s.clone()));
            out.push((format!("optim.{n}.exp_avg_sq"), DType::F32, s.clone()));
        }
    }
    out
}

fn dtype_size(d: DType) -> u64 {
    match d {
        DType::BF16 | DType::F16 => 2,
        _ => 4,
    }
}

/// Bytes of a layout.
fn layout_bytes(l: &[(String, DType, Vec<u64>)]) -> u64 {
    l.iter().map(|(_, d, s)| numel(s) * dtype_size(*d)).sum()
}

/// Weight-like values: uniform in `[-scale, scale)`, from a fast generator.
/// `square` gives non-negative tiny values (a second moment).
fn values(dtype: DType, n: usize, seed: u64, scale: f32, square: bool) -> Vec<u8> {
    let mut rng = Xorshift::new(seed);
    let size = dtype_size(dtype) as usize;
    let mut out = Vec::with_capacity(n * size);
    for _ in 0..n {
        let u = rng.next_signed_unit();
        let v = if square {
            (u * scale) * (u * scale)
        } else {
            u * scale
        };
        if size == 2 {
            out.extend_from_slice(&((v.to_bits() >> 16) as u16).to_le_bytes());
        } else {
            out.extend_from_slice(&v.to_le_bytes());
        }
    }
    out
}

impl ModelState {
    /// Generate the state (deterministic in `seed`).
    pub fn build(&self) -> Result<State, String> {
        let full = shapes(&self.model)
            .ok_or_else(|| format!("unknown model {:?} (known: {MODELS:?})", self.model))?;
        let full_bytes = layout_bytes(&layout(&full, self.mix, self.optimizer));
        // Dimensions of 1 (and rounding) keep the total from scaling exactly with
        // the factor: search the factor (bisection on its logarithm) instead.
        let scaled = |f: f64| -> Vec<(String, Vec<u64>)> {
            full.iter()
                .map(|(n, s)| (n.clone(), scale_shape(s, f)))
                .collect()
        };
        let bytes_at = |f: f64| layout_bytes(&layout(&scaled(f), self.mix, self.optimizer)) as f64;
        let target = self.bytes as f64;
        let factor = if target >= full_bytes as f64 {
            1.0
        } else {
            let (mut lo, mut hi) = ((1e-12f64).ln(), 0.0f64);
            for _ in 0..40 {
                let mid = (lo + hi) / 2.0;
                if bytes_at(mid.exp()) > target {
                    hi = mid;
                } else {
                    lo = mid;
                }
            }
            lo.exp()
        };
        let params = scaled(factor);
        let mut state = State::new();
        for (i, (name, dtype, shape)) in layout(&params, self.mix, self.optimizer)
            .into_iter()
            .enumerate()
        {
            let n = numel(&shape) as usize;
            let square = name.ends_with("exp_avg_sq");
            let scale = if name.ends_with("exp_avg") {
                1e-3
            } else {
                0.02
            };
            let data = values(
                dtype,
                n,
                self.seed.wrapping_add(i as u64 * 7919),
                scale,
                square,
            );
            let t =
                Tensor::new(name, dtype, shape, Bytes::from(data)).map_err(|e| e.to_string())?;
            state = state.with_tensor(t);
        }
        Ok(state)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn full_sizes_match_published_parameter_counts() {
        let count = |m: &str| {
            shapes(m)
                .unwrap()
                .iter()
                .map(|(_, s)| numel(s))
                .sum::<u64>()
        };
        // ResNet-50 25.6 M, BERT-large ~335 M (without the pooler and a few norms
        // biases), GPT-2 XL 1.56 B, Llama-3-8B 8.03 B.
        let within = |m: &str, want: f64, tol: f64| {
            let got = count(m) as f64;
            assert!((got / want - 1.0).abs() < tol, "{m}: {got} vs {want}");
        };
        within("resnet50", 25.5e6, 0.02);
        within("bert-large", 334e6, 0.02);
        within("gpt2-xl", 1.557e9, 0.01);
        within("llama3-8b", 8.03e9, 0.01);
    }

    #[test]
    fn scaled_state_is_near_the_target_with_optimizer_and_mix() {
        for m in MODELS {
            let s = ModelState {
                model: m.to_string(),
                bytes: 8 << 20,
                mix: DtypeMix::Bf16,
                optimizer: true,
                seed: 1,
            }
            .build()
            .unwrap();
            let total = s.nbytes() as f64;
            assert!(
                (total / (8 << 20) as f64 - 1.0).abs() < 0.25,
                "{m}: {total}"
            );
            let params = s
                .tensors
                .iter()
                .filter(|t| t.name.starts_with("model."))
                .count();
            assert_eq!(
                s.tensors.len(),
                params * 4,
                "{m}: master + two moments per parameter"
            );
            assert!(s.tensors.iter().any(|t| t.dtype == DType::BF16));
        }
        let a = ModelState {
            model: "gpt2-xl".into(),
            bytes: 1 << 20,
            mix: DtypeMix::Fp32,
            optimizer: false,
            seed: 3,
        };
        assert_eq!(a.build().unwrap(), a.build().unwrap(), "deterministic");
        assert!(ModelState {
            model: "nope".into(),
            ..a
        }
        .build()
        .is_err());
    }

    #[test]
    fn scaling_keeps_rank_and_floor() {
        assert_eq!(scale_shape(&[100, 100], 0.25), vec![50, 50]);
        assert_eq!(scale_shape(&[8], 0.0), vec![1]);
    }
}
