//! Capture of `tch` tensors into a [`Capture`] for the engine.

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};

use bytes::Bytes;

use tch::{Device, Tensor};

use super::cuda::{queue_pinned_copy, CudaFence, PinnedTensorSource};
use super::kind::{dtype_of, shape_of};
use super::tch_err;
use crate::error::{Error, Result};
use crate::model::value::{Key, Value};
use crate::save::snapshot::{Capture, CopySource, SourceTensor, TensorData};
use crate::sync::MutexExt;

/// A [`CopySource`] over a contiguous CPU `tch::Tensor` (a shallow clone: the same
/// memory as the caller's tensor). The snapshot copies it into a staging buffer.
///
/// The caller must not mutate the tensor until the save's snapshot is complete
/// (`wait_snapshot()` in lazy mode).
#[derive(Debug)]
pub struct CpuTensorSource {
    // tch::Tensor is Send but not Sync; the lock makes the source shareable.
    tensor: Mutex<Tensor>,
    numel: usize,
    len: usize,
}

impl CpuTensorSource {
    /// Wrap a CPU tensor. A non-contiguous tensor is first made contiguous (a
    /// private copy taken now).
    pub fn new(t: &Tensor) -> Result<Arc<Self>> {
        if t.device() != Device::Cpu {
            return Err(Error::InvalidInput(format!(
                "CpuTensorSource needs a CPU tensor, got one on {:?}",
                t.device()
            )));
        }
        let kind = t.f_kind().map_err(|e| tch_err("read a tensor's kind", e))?;
        let tensor = tch::no_grad(|| {
            if t.is_contiguous() {
                Ok(t.shallow_clone())
            } else {
                t.f_contiguous()
            }
        })
        .map_err(|e| tch_err("make a tensor contiguous", e))?;
        let numel = tensor.numel();
        let len = numel
            .checked_mul(kind.elt_size_in_bytes())
            .ok_or_else(|| Error::InvalidInput("tensor byte size overflows".into()))?;
        Ok(Arc::new(CpuTensorSource {
            tensor: Mutex::new(tensor),
            numel,
            len,
        }))
    }
}

impl CopySource for CpuTensorSource {
    fn len(&self) -> usize {
        self.len
    }

    fn copy_into(&self, dst: &mut [u8]) -> Result<()> {
        if dst.len() != self.len {
            return Err(Error::Internal(format!(
                "staging buffer of {} bytes for a tensor of {}",
                dst.len(),
                self.len
            )));
        }
        if self.numel == 0 {
            return Ok(());
        }
        let t = self.tensor.lock_unpoisoned();
        t.f_copy_data_u8(dst, self.numel)
            .map_err(|e| tch_err("copy a tensor into staging", e))
    }
}

/// Builds a [`Capture`] from `tch` tensors, `VarStore`s and plain data.
///
/// Non-tensor state goes into a map (`meta(key, value)`); the checkpoint's meta is
/// that map, in insertion order.
#[derive(Debug, Default)]
pub struct TorchCapture {
    tensors: Vec<SourceTensor>,
    meta: Vec<(Key, Value)>,
    fence: Arc<CudaFence>,
    cuda_devices: BTreeSet<usize>,
    /// CUDA tensors: their index in `tensors` and their pinned copy.
    pinned: Vec<(usize, Arc<PinnedTensorSource>)>,
}

impl TorchCapture {
    /// An empty capture.
    pub fn new() -> Self {
        Self::default()
    }

    /// Add one tensor under `name`. CPU tensors are copied at snapshot time; CUDA
    /// tensors get their device-to-host copy queued now.
    pub fn tensor(&mut self, name: impl Into<String>, t: &Tensor) -> Result<()> {
        let name = name.into();
        let kind = t.f_kind().map_err(|e| tch_err("read a tensor's kind", e))?;
        let dtype = dtype_of(kind).map_err(|e| match e {
            Error::Unsupported(m) => Error::Unsupported(format!("tensor `{name}`: {m}")),
            other => other,
        })?;
        let shape = shape_of(t)?;
        let source: Arc<dyn CopySource> = match t.device() {
            Device::Cpu => CpuTensorSource::new(t)?,
            Device::Cuda(i) => {
                self.cuda_devices.insert(i);
                let src = Arc::new(queue_pinned_copy(t, i, &self.fence)?);
                self.pinned.push((self.tensors.len(), src.clone()));
                src
            }
            other => {
                return Err(Error::Unsupported(format!(
                    "tensor `{name}` is on {other:?}; only CPU and CUDA tensors can be captured"
                )))
            }
        };
        self.tensors.push(SourceTensor {
            name,
            dtype,
            shape,
            shard: None,
            data: TensorData::Copy(source),
        });
        Ok(())
    }

    /// Add every variable of a `VarStore` as `prefix + variable name`, in name order.
    /// Returns how many were added.
    pub fn var_store(&mut self, prefix: &str, vs: &tch::nn::VarStore) -> Result<usize> {
        let mut vars: Vec<(String, Tensor)> = vs.variables().into_iter().collect();
        vars.sort_by(|a, b| a.0.cmp(&b.0));
        for (name, t) in &vars {
            self.tensor(format!("{prefix}{name}"), t)?;
        }
        Ok(vars.len())
    }

    /// Add one entry of plain data to the checkpoint's meta map.
    pub fn meta(&mut self, key: impl Into<Key>, value: Value) {
        self.meta.push((key.into(), value));
    }

    /// Number of tensors captured so far.
    pub fn len(&self) -> usize {
        self.tensors.len()
    }

    /// True when no tensor was captured.
    pub fn is_empty(&self) -> bool {
        self.tensors.is_empty()
    }

    /// Total tensor bytes captured so far.
    pub fn nbytes(&self) -> u64 {
        self.tensors.iter().map(|t| t.data.len() as u64).sum()
    }

    /// Wait until every queued device-to-host copy is complete. The snapshot does
    /// this by itself; call it to time the copies or before dropping the capture.
    pub fn synchronize(&self) -> Result<()> {
        for &d in &self.cuda_devices {
            self.fence.wait(d)?;
        }
        Ok(())
    }

    /// Wait for the queued device-to-host copies and hand their pinned buffers to
    /// the engine as they are, instead of copying them into staging at snapshot time.
    ///
    /// For eager saves of CUDA state this is the shortest stall: the caller waits
    /// for the device-to-host copies alone. The pinned buffers (from libtorch's
    /// caching host allocator, outside the staging budget) then live until the save
    /// has persisted them. CPU tensors are unaffected.
    pub fn settle(&mut self) -> Result<()> {
        self.synchronize()?;
        for (i, src) in self.pinned.drain(..) {
            let bytes = Bytes::from_owner(src.settled()?);
            self.tensors[i].data = TensorData::Shared(bytes);
        }
        Ok(())
    }
}

impl From<TorchCapture> for Capture {
    fn from(c: TorchCapture) -> Self {
        Capture {
            tensors: c.tensors,
            meta: Value::Map(c.meta),
            ready: None,
        }
    }
}
