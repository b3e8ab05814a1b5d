//! Generated training states.

use std::sync::Arc;

use bytes::Bytes;
use ckpt_core::sync::RwLockExt;
use ckpt_core::{Capture, DType, SharedVec, State, Tensor};

pub use ckpt_core::testing::seeded_bytes as fill;

/// A state of `n` F32 tensors sharing `total` bytes.
pub fn uniform_f32(n: usize, total: usize, seed: u64) -> State {
    let per = (total / n / 4).max(1);
    (0..n).fold(State::new(), |s, i| {
        let t = Tensor::new(
            format!("layers.{i}.weight"),
            DType::F32,
            vec![per as u64],
            Bytes::from(fill(seed + i as u64, per * 4)),
        )
        .expect("valid");
        s.with_tensor(t)
    })
}

/// The training loop's view of a state: mutable buffers that a save must copy.
pub struct Params {
    /// One buffer per tensor.
    pub bufs: Vec<Arc<SharedVec>>,
    /// Names, dtypes and shapes.
    pub meta: Vec<(String, DType, Vec<u64>)>,
}

impl Params {
    /// Mutable copies of a state's tensors.
    pub fn from_state(state: &State) -> Self {
        Params {
            bufs: state
                .tensors
                .iter()
                .map(|t| SharedVec::new(t.data.to_vec()))
                .collect(),
            meta: state
                .tensors
                .iter()
                .map(|t| (t.name.clone(), t.dtype, t.shape.clone()))
                .collect(),
        }
    }

    /// A capture that copies every buffer at snapshot time.
    pub fn capture(&self) -> Capture {
        self.bufs
            .iter()
            .zip(&self.meta)
            .fold(Capture::default(), |c, (b, (n, d, s))| {
                c.with_copy(n.clone(), *d, s.clone(), b.clone())
            })
    }

    /// Total bytes.
    pub fn nbytes(&self) -> u64 {
        self.bufs
            .iter()
            .map(|b| ckpt_core::CopySource::len(b.as_ref()) as u64)
            .sum()
    }

    /// Change every `stride`-th byte block so that every chunk of `chunk` bytes differs
    /// from any earlier save (an optimizer step touches every parameter).
    pub fn touch_all(&self, step: u64, chunk: usize) {
        for b in &self.bufs {
            let mut v = b.0.write_unpoisoned();
            let len = v.len();
            for off in (0..len).step_by(chunk.max(1)) {
                let end = (off + 8).min(len);
                v[off..end].copy_from_slice(&step.to_le_bytes()[..end - off]);
            }
        }
    }

    /// Rewrite whole tensors (the listed indices) with fresh bytes.
    pub fn rewrite(&self, which: &[usize], seed: u64) {
        for &i in which {
            let mut v = self.bufs[i].0.write_unpoisoned();
            let n = v.len();
            v.copy_from_slice(&fill(seed + i as u64, n));
        }
    }
}
