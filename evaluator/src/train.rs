//! A small real model for the determinism experiment: a two-layer MLP (tanh)
//! regressing a fixed random teacher, trained with Adam on mini-batches drawn
//! from a seeded generator. Single-threaded f32 arithmetic in a fixed order, so
//! a run is bitwise reproducible; its whole training state (parameters, Adam
//! moments, step, generator state) round-trips through a [`State`].

use bytes::Bytes;
use ckpt_core::testing::Xorshift;
use ckpt_core::{DType, State, Tensor, Value};

/// Sizes of the model.
pub const IN: usize = 16;
/// Hidden units.
pub const HIDDEN: usize = 32;
/// Mini-batch size.
pub const BATCH: usize = 8;

/// The next value of the stream whose state is `rng`, uniform in `[-1, 1)`.
fn next(rng: &mut u64) -> f32 {
    let mut g = Xorshift { state: *rng };
    let v = g.next_signed_unit();
    *rng = g.state;
    v
}

/// The full training state.
#[derive(Debug, Clone, PartialEq)]
pub struct Trainer {
    /// Parameters: w1 (HIDDEN x IN), b1 (HIDDEN), w2 (HIDDEN), b2 (1).
    pub params: Vec<Vec<f32>>,
    /// Adam first moments, one per parameter.
    pub m: Vec<Vec<f32>>,
    /// Adam second moments.
    pub v: Vec<Vec<f32>>,
    /// Steps taken.
    pub step: u64,
    /// Data generator state.
    pub rng: u64,
}

const NAMES: [&str; 4] = ["w1", "b1", "w2", "b2"];

impl Trainer {
    /// A fresh model from `seed`.
    pub fn new(seed: u64) -> Trainer {
        let mut rng = Xorshift::new(seed).state;
        let sizes = [HIDDEN * IN, HIDDEN, HIDDEN, 1];
        let params: Vec<Vec<f32>> = sizes
            .iter()
            .map(|&n| (0..n).map(|_| next(&mut rng) * 0.3).collect())
            .collect();
        Trainer {
            m: sizes.iter().map(|&n| vec![0.0; n]).collect(),
            v: sizes.iter().map(|&n| vec![0.0; n]).collect(),
            params,
            step: 0,
            rng,
        }
    }

    /// The teacher's target for input `x`.
    fn target(x: &[f32]) -> f32 {
        x.iter()
            .enumerate()
            .map(|(i, v)| v * ((i as f32 * 0.7).sin()))
            .sum::<f32>()
            .tanh()
    }

    /// One Adam step on a fresh mini-batch; returns the batch loss.
    pub fn train_step(&mut self) -> f32 {
        let (lr, b1, b2, eps) = (1e-2f32, 0.9f32, 0.999f32, 1e-8f32);
        let mut grads: Vec<Vec<f32>> = self.params.iter().map(|p| vec![0.0; p.len()]).collect();
        let mut loss = 0.0;
        for _ in 0..BATCH {
            let x: Vec<f32> = (0..IN).map(|_| next(&mut self.rng)).collect();
            let y = Self::target(&x);
            let (w1, bias1, w2, bias2) = (
                &self.params[0],
                &self.params[1],
                &self.params[2],
                self.params[3][0],
            );
            let h: Vec<f32> = (0..HIDDEN)
                .map(|j| (bias1[j] + (0..IN).map(|i| w1[j * IN + i] * x[i]).sum::<f32>()).tanh())
                .collect();
            let out = bias2 + (0..HIDDEN).map(|j| w2[j] * h[j]).sum::<f32>();
            let d = out - y;
            loss += d * d / BATCH as f32;
            let dout = 2.0 * d / BATCH as f32;
            for j in 0..HIDDEN {
                grads[2][j] += dout * h[j];
                let dh = dout * w2[j] * (1.0 - h[j] * h[j]);
                grads[1][j] += dh;
                for i in 0..IN {
                    grads[0][j * IN + i] += dh * x[i];
                }
            }
            grads[3][0] += dout;
        }
        self.step += 1;
        let t = self.step as i32;
        let (c1, c2) = (1.0 - b1.powi(t), 1.0 - b2.powi(t));
        let groups = self
            .params
            .iter_mut()
            .zip(&mut self.m)
            .zip(&mut self.v)
            .zip(&grads);
        for (((p, m), v), g) in groups {
            for (((p, m), v), &g) in p.iter_mut().zip(m.iter_mut()).zip(v.iter_mut()).zip(g) {
                *m = b1 * *m + (1.0 - b1) * g;
                *v = b2 * *v + (1.0 - b2) * g * g;
                *p -= lr * (*m / c1) / ((*v / c2).sqrt() + eps);
            }
        }
        loss
    }

    /// The training state as a checkpointable [`State`].
    pub fn to_state(&self) -> State {
        let mut s = State::new();
        for (group, vals) in [
            ("param", &self.params),
            ("adam.m", &self.m),
            ("adam.v", &self.v),
        ] {
            for (name, v) in NAMES.iter().zip(vals.iter()) {
                let bytes: Vec<u8> = v.iter().flat_map(|f| f.to_le_bytes()).collect();
                let t = Tensor::new(
                    format!("{group}.{name}"),
                    DType::F32,
                    vec![v.len() as u64],
                    Bytes::from(bytes),
                )
                .expect("valid tensor");
                s = s.with_tensor(t);
            }
        }
        s.with_meta(Value::map([
            ("step", Value::Int(self.step as i64)),
            ("rng", Value::Bytes(self.rng.to_le_bytes().to_vec())),
        ]))
    }

    /// Rebuild from a [`State`] written by [`Trainer::to_state`].
    pub fn from_state(s: &State) -> Result<Trainer, String> {
        let get = |group: &str| -> Result<Vec<Vec<f32>>, String> {
            NAMES
                .iter()
                .map(|n| {
                    let name = format!("{group}.{n}");
                    let t = s
                        .tensors
                        .iter()
                        .find(|t| t.name == name)
                        .ok_or(format!("missing {name}"))?;
                    Ok(t.data
                        .chunks_exact(4)
                        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                        .collect())
                })
                .collect()
        };
        let step = s
            .meta
            .get("step")
            .and_then(Value::as_int)
            .ok_or("missing step")? as u64;
        let rng = match s.meta.get("rng") {
            Some(Value::Bytes(b)) if b.len() == 8 => {
                u64::from_le_bytes(b[..8].try_into().expect("8 bytes"))
            }
            _ => return Err("missing rng".into()),
        };
        Ok(Trainer {
            params: get("param")?,
            m: get("adam.m")?,
            v: get("adam.v")?,
            step,
            rng,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn training_learns_and_is_reproducible() {
        let mut a = Trainer::new(5);
        let first: f32 = (0..20).map(|_| a.train_step()).sum::<f32>() / 20.0;
        let last: f32 = (0..300).map(|_| a.train_step()).last().unwrap();
        let tail: f32 = (0..20).map(|_| a.train_step()).sum::<f32>() / 20.0;
        assert!(
            tail < first * 0.5,
            "loss did not fall: {first} -> {tail} ({last})"
        );
        let mut b = Trainer::new(5);
        for _ in 0..340 {
            b.train_step();
        }
        assert_eq!(a, b);
    }

    #[test]
    fn state_round_trip() {
        let mut a = Trainer::new(9);
        for _ in 0..3 {
            a.train_step();
        }
        assert_eq!(Trainer::from_state(&a.to_state()).unwrap(), a);
        assert!(Trainer::from_state(&State::new()).is_err());
    }
}
