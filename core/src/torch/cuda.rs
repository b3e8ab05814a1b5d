//! The CUDA side of a capture: non-blocking device-to-host copies into pinned host
//! memory, and the synchronisation that makes them safe to read.

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};

use tch::{Device, Tensor};

use super::tch_err;
use crate::error::{Error, Result};
use crate::save::snapshot::CopySource;
use crate::sync::MutexExt;

/// Devices whose queued copies have been waited for, shared by the sources of one
/// capture so that each device is synchronised once per snapshot.
#[derive(Debug, Default)]
pub(crate) struct CudaFence {
    synced: Mutex<BTreeSet<usize>>,
}

impl CudaFence {
    pub(crate) fn wait(&self, device: usize) -> Result<()> {
        let mut synced = self.synced.lock_unpoisoned();
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
        let host = self.host.lock_unpoisoned();
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
        let host = self.host.lock_unpoisoned();
        host.f_copy_data_u8(dst, self.numel)
            .map_err(|e| tch_err("copy a pinned buffer into staging", e))
    }
}

/// Queue a non-blocking copy of a CUDA tensor into pinned host memory.
///
/// `Tensor::to` with `non_blocking` from CUDA to the CPU allocates its output in
/// pinned memory (libtorch's caching host allocator, so repeated saves reuse it).
pub(crate) fn queue_pinned_copy(
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

/// A settled pinned buffer, owned by the `Bytes` handed to the engine.
pub(crate) struct PinnedBytes {
    // Keeps the memory alive; nothing else holds this tensor, so nobody writes it.
    _host: Tensor,
    ptr: *const u8,
    len: usize,
}

// SAFETY: the pointer is to the memory of `_host`, a private contiguous CPU tensor
// that is never written after the copy into it completed (the device was
// synchronised before this value was made), and tch::Tensor is Send.
unsafe impl Send for PinnedBytes {}

impl AsRef<[u8]> for PinnedBytes {
    fn as_ref(&self) -> &[u8] {
        if self.len == 0 {
            return &[];
        }
        // SAFETY: see the Send impl; `len` bytes from `ptr` are the tensor's data.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

impl PinnedTensorSource {
    /// The pinned buffer as immutable bytes. The caller must have synchronised.
    pub(crate) fn settled(&self) -> Result<PinnedBytes> {
        self.fence.wait(self.device)?;
        let host = self.host.lock_unpoisoned();
        let host = host.shallow_clone();
        if !host.is_contiguous() || host.device() != Device::Cpu {
            return Err(Error::Internal(
                "pinned copy is not a contiguous CPU tensor".into(),
            ));
        }
        Ok(PinnedBytes {
            ptr: host.data_ptr() as *const u8,
            len: self.len,
            _host: host,
        })
    }
}
