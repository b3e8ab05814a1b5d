//! Capture of `tch` tensors into a [`Capture`] for the engine.

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};

use tch::{Device, Tensor};

use super::kind::{dtype_of, shape_of};
use super::tch_err;
use crate::error::{Error, Result};
use crate::snapshot::{Capture, CopySource, SourceTensor, TensorData};
use crate::value::{Key, Value};

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
        let t = self.tensor.lock().unwrap_or_else(|p| p.into_inner());
        t.f_copy_data_u8(dst, self.numel)
            .map_err(|e| tch_err("copy a tensor into staging", e))
    }
}

/// Devices whose queued copies have been waited for, shared by the sources of one
/// capture so that each device is synchronised once per snapshot.
#[derive(Debug, Default)]
pub(super) struct CudaFence {
    synced: Mutex<BTreeSet<usize>>,
}

impl CudaFence {
    fn wait(&self, device: usize) -> Result<()> {
        let mut synced = self.synced.lock().unwrap_or_else(|p| p.into_inner());
        if synced.contains(&device) {
            return Ok(());
        }
        // tch reports a CUDA failure here as a panic; turn it into an error.
        std::panic::catch_unwind(|| tch::Cuda::synchronize(device as i64)).map_err(|p| {
            let msg = p
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_default();
            Error::Internal(format!("synchronising cuda:{device} failed: {msg}"))
        })?;
        synced.insert(device);
        Ok(())
    }
}

/// A [`CopySource`] over a pinned host copy of a CUDA tensor.
///
/// The device-to-host copy was queued (non-blocking) on the tensor's current stream
/// when the tensor was captured; `copy_into` synchronises the device first, so the
/// bytes are complete before anything reads them. Kernels the loop queues later on
/// the same stream (an optimizer step) run after the copy, so only other streams
/// need the loop to wait for the snapshot.
#[derive(Debug)]
pub struct PinnedTensorSource {
    host: Mutex<Tensor>,
    device: usize,
    fence: Arc<CudaFence>,
    numel: usize,
    len: usize,
}

impl PinnedTensorSource {
    /// True when the host buffer is page-locked (the non-blocking copy really ran
    /// asynchronously; otherwise libtorch copied synchronously).
    pub fn is_pinned(&self) -> bool {
        let host = self.host.lock().unwrap_or_else(|p| p.into_inner());
        host.f_is_pinned(Device::Cuda(self.device)).unwrap_or(false)
    }
}

impl CopySource for PinnedTensorSource {
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
        self.fence.wait(self.device)?;
        if self.numel == 0 {
            return Ok(());
        }
        let host = self.host.lock().unwrap_or_else(|p| p.into_inner());
        host.f_copy_data_u8(dst, self.numel)
            .map_err(|e| tch_err("copy a pinned buffer into staging", e))
    }
}

/// Queue a non-blocking copy of a CUDA tensor into pinned host memory.
///
/// `Tensor::to` with `non_blocking` from CUDA to the CPU allocates its output in
/// pinned memory (libtorch's caching host allocator, so repeated saves reuse it).
pub(super) fn queue_pinned_copy(
    t: &Tensor,
    device: usize,
    fence: &Arc<CudaFence>,
) -> Result<PinnedTensorSource> {
    let kind = t.f_kind().map_err(|e| tch_err("read a tensor's kind", e))?;
    let host = tch::no_grad(|| {
        let src = if t.is_contiguous() {
            t.shallow_clone()
        } else {
            t.f_contiguous()?
        };
        src.f_to_device_(Device::Cpu, kind, true, true)
    })
    .map_err(|e| tch_err("queue a device-to-host copy", e))?;
    let numel = host.numel();
    let len = numel
        .checked_mul(kind.elt_size_in_bytes())
        .ok_or_else(|| Error::InvalidInput("tensor byte size overflows".into()))?;
    Ok(PinnedTensorSource {
        host: Mutex::new(host),
        device,
        fence: fence.clone(),
        numel,
        len,
    })
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
                Arc::new(queue_pinned_copy(t, i, &self.fence)?)
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
}

impl From<TorchCapture> for Capture {
    fn from(c: TorchCapture) -> Self {
        Capture {
            tensors: c.tensors,
            meta: Value::Map(c.meta),
        }
    }
}
