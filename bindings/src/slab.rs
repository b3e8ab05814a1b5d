//! Host memory a GPU copies a snapshot into, saved without a second copy.
//!
//! [`HostSlab`] is a [`ckpt_core::Slab`] (one page mapping, a slot per tensor)
//! exported to Python as a writable buffer, so the glue can view it as a
//! torch tensor, page-lock it with the CUDA runtime (`cudaHostRegister`) and
//! queue device-to-host copies into its slots. `save` takes a slot
//! ([`HostSlab::slot`]) as the tensor's bytes, shared, not copied; the copies
//! still in flight are awaited through the `ready` callable ([`PyReady`])
//! before the engine reads anything. The glue must not write a slab again
//! while [`HostSlab::in_use`] is true; [`HostSlab::on_release`] tells it when
//! that ends. A slab made by `Checkpointer.new_slab` holds its size of the
//! checkpointer's staging budget ([`ckpt_core::staging::Charge`]) until a
//! save lets go of its last bytes; the glue charges it again
//! (`Checkpointer.charge_slab`) before the next save uses it. So CPU staging
//! and slabs in use share one budget, and a free slab never holds budget a
//! CPU save waits for.

use std::os::raw::c_int;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use ckpt_core::staging::{Charge, StagingPool};
use ckpt_core::sync::MutexExt;
use ckpt_core::{Error, Ready, Slab};
use pyo3::ffi;
use pyo3::prelude::*;

use crate::buffer::export_bytes;
use crate::errors::to_py;

/// Page-mapped host memory with one slot per tensor of a save.
#[pyclass(frozen, module = "ckpt._ckpt")]
pub struct HostSlab {
    slab: Slab,
    release: Arc<Release>,
}

/// The slot bytes of one layout a save still holds, and what to call once it
/// holds none.
#[derive(Default)]
struct Release {
    live: AtomicUsize,
    hook: Mutex<Option<Arc<Py<PyAny>>>>,
    /// The pool the slab is charged to: told when it is free for reuse.
    pool: Option<StagingPool>,
    /// The staging budget the slab holds; `None` when uncharged.
    charge: Mutex<Option<Charge>>,
}

impl Release {
    /// A fresh layout's, with the same hook.
    fn next(&self) -> Arc<Release> {
        Arc::new(Release {
            live: AtomicUsize::new(0),
            hook: Mutex::new(self.hook.lock_unpoisoned().clone()),
            pool: self.pool.clone(),
            // The same memory: its charge moves to the new layout.
            charge: Mutex::new(self.charge.lock_unpoisoned().take()),
        })
    }

    /// The last held bytes were let go: wake saves waiting for staging
    /// memory (they may reuse this slab), and call the hook on a thread of
    /// its own (this one may be the engine's, which must not wait for the GIL).
    fn fire(&self) {
        if let Some(pool) = &self.pool {
            pool.nudge();
        }
        let Some(hook) = self.hook.lock_unpoisoned().clone() else {
            return;
        };
        let call = move || {
            Python::try_attach(|py| {
                if let Err(e) = hook.call0(py) {
                    e.write_unraisable(py, None);
                }
                drop(hook);
            });
        };
        // Best effort: without a thread, the glue's wait finds the slab free later.
        let _ = std::thread::Builder::new()
            .name("ckpt-slab-release".into())
            .spawn(call);
    }
}

/// Slot bytes handed to a save: the core's, counted in their layout's
/// [`Release`] until dropped (after the core's, so the slab is no longer in
/// use by the time the count falls to zero).
struct Counted {
    /// `None` once dropped (see `Drop`).
    bytes: Option<Bytes>,
    _held: Held,
}

struct Held(Arc<Release>);

impl Drop for Counted {
    fn drop(&mut self) {
        // The last bytes a save holds: the slab gives its budget back. Taken
        // while the slab is still in use, so whoever finds it free finds it
        // uncharged too (and charges it again to use it); given back once it
        // is free, so the save that the return wakes can reuse it.
        let release = &self._held.0;
        let charge = if release.live.load(Ordering::Acquire) == 1 {
            release.charge.lock_unpoisoned().take()
        } else {
            None
        };
        drop(self.bytes.take());
        drop(charge);
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        if self.0.live.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.0.fire();
        }
    }
}

impl AsRef<[u8]> for Counted {
    fn as_ref(&self) -> &[u8] {
        self.bytes.as_deref().unwrap_or(&[])
    }
}

/// Slot `index` of a [`HostSlab`], handed to `save` as a tensor's bytes.
#[pyclass(frozen, module = "ckpt._ckpt")]
pub struct SlabSlot {
    slab: Py<HostSlab>,
    index: usize,
}

impl HostSlab {
    /// A slab of `slab`'s memory holding `charge` of `pool`'s budget.
    pub fn charged_to(slab: Slab, pool: StagingPool, charge: Charge) -> Self {
        HostSlab {
            slab,
            release: Arc::new(Release {
                pool: Some(pool),
                charge: Mutex::new(Some(charge)),
                ..Release::default()
            }),
        }
    }
}

impl HostSlab {
    /// Whether the slab is charged to a pool (made by `new_slab`).
    pub fn pool(&self) -> Option<&StagingPool> {
        self.release.pool.as_ref()
    }

    /// Hold `charge` of its pool's budget (the slab's again, for a save).
    pub fn recharge(&self, charge: Charge) {
        *self.release.charge.lock_unpoisoned() = Some(charge);
    }

    /// Bytes mapped.
    pub fn byte_len(&self) -> usize {
        self.slab.len()
    }
}

impl SlabSlot {
    /// The slot's bytes (shared with the slab, no copy).
    pub fn bytes(&self, py: Python<'_>) -> PyResult<Bytes> {
        let slab = self.slab.bind(py).get();
        let bytes = slab.slab.slot(self.index).map_err(to_py)?;
        if bytes.is_empty() {
            return Ok(bytes); // (holds nothing of the slab)
        }
        slab.release.live.fetch_add(1, Ordering::AcqRel);
        let held = Held(slab.release.clone());
        Ok(Bytes::from_owner(Counted {
            bytes: Some(bytes),
            _held: held,
        }))
    }
}

#[pymethods]
impl HostSlab {
    /// A zeroed slab with a slot of each length (bytes), in order, charged
    /// to no budget.
    #[new]
    fn new(py: Python<'_>, lens: Vec<usize>) -> PyResult<Self> {
        let slab = py.detach(|| Slab::new(&lens)).map_err(to_py)?;
        Ok(HostSlab {
            slab,
            release: Arc::default(),
        })
    }

    /// Bytes of a staging budget this slab holds (0: none).
    #[getter]
    pub fn charged(&self) -> u64 {
        self.release
            .charge
            .lock_unpoisoned()
            .as_ref()
            .map_or(0, Charge::bytes)
    }

    /// Give the slab's budget back now (it is being dropped: write it no more).
    fn discharge(&self) {
        drop(self.release.charge.lock_unpoisoned().take());
    }

    /// Address of the first byte (for `cudaHostRegister`).
    #[getter]
    fn address(&self) -> usize {
        self.slab.address()
    }

    /// Bytes mapped.
    #[getter]
    fn nbytes(&self) -> usize {
        self.slab.len()
    }

    /// `(offset, length)` of each slot.
    #[getter]
    fn slots(&self) -> Vec<(usize, usize)> {
        self.slab.slots().to_vec()
    }

    /// Whether this slab has exactly these slot lengths, in order.
    fn fits(&self, lens: Vec<usize>) -> bool {
        self.slab.fits(&lens)
    }

    /// The same memory with a slot of each of `lens` (a save of other shapes
    /// reusing page-locked memory), or None when it has no room or a save
    /// still holds its bytes. Use this slab no more afterwards.
    fn relayout(&self, lens: Vec<usize>) -> PyResult<Option<HostSlab>> {
        Ok(self
            .slab
            .relayout(&lens)
            .map_err(to_py)?
            .map(|slab| HostSlab {
                slab,
                release: self.release.next(),
            }))
    }

    /// True while a save still holds bytes of this slab (do not write it).
    fn in_use(&self) -> bool {
        self.slab.in_use()
    }

    /// Call `callback()` each time the saves let go of the last bytes of this
    /// slab they held (once `in_use` is false), on a thread of its own; a
    /// `relayout` of it keeps it. None to call nothing.
    fn on_release(&self, callback: Option<Py<PyAny>>) {
        *self.release.hook.lock_unpoisoned() = callback.map(Arc::new);
    }

    /// Map every page now, on `threads` threads, without the GIL (a fresh
    /// slab's first fill or page-locking would otherwise fault it in page by page).
    #[pyo3(signature = (threads=8))]
    fn populate(&self, py: Python<'_>, threads: usize) -> PyResult<()> {
        py.detach(|| self.slab.populate(threads)).map_err(to_py)
    }

    /// `populate` while another thread may write into the slab (a restore's
    /// read): the kernel's advice alone, which changes no byte; nothing is
    /// touched where the kernel lacks it. Whether every page was mapped.
    #[pyo3(signature = (threads=8))]
    fn populate_beside_writes(&self, py: Python<'_>, threads: usize) -> bool {
        py.detach(|| self.slab.populate_beside_writes(threads))
    }

    /// Slots `indices`, in one call (a save hands over a thousand).
    fn slot_list(slf: Bound<'_, Self>, indices: Vec<usize>) -> PyResult<Vec<SlabSlot>> {
        let n = slf.get().slab.slots().len();
        if let Some(bad) = indices.iter().find(|&&i| i >= n) {
            return Err(to_py(Error::InvalidInput(format!(
                "slab has no slot {bad}"
            ))));
        }
        Ok(indices
            .into_iter()
            .map(|index| SlabSlot {
                slab: slf.clone().unbind(),
                index,
            })
            .collect())
    }

    /// Slot `index`, to hand to `save` as a tensor's bytes.
    fn slot(slf: Bound<'_, Self>, index: usize) -> PyResult<SlabSlot> {
        if index >= slf.get().slab.slots().len() {
            return Err(to_py(Error::InvalidInput(format!(
                "slab has no slot {index}"
            ))));
        }
        Ok(SlabSlot {
            slab: slf.unbind(),
            index,
        })
    }

    unsafe fn __getbuffer__(
        slf: Bound<'_, Self>,
        view: *mut ffi::Py_buffer,
        flags: c_int,
    ) -> PyResult<()> {
        let (ptr, len) = (slf.get().slab.address(), slf.get().slab.len());
        // Writable: the glue fills the slots (only while no save holds them).
        // SAFETY: the mapping lives as long as the slab, which the view owns.
        unsafe { export_bytes(slf.as_any(), view, ptr, len, flags, false) }
    }

    unsafe fn __releasebuffer__(&self, _view: *mut ffi::Py_buffer) {}

    fn __repr__(&self) -> String {
        format!(
            "HostSlab({} slots, {} bytes{})",
            self.slab.slots().len(),
            self.slab.len(),
            if self.slab.in_use() { ", in use" } else { "" }
        )
    }
}

#[pymethods]
impl SlabSlot {
    /// Which slot of its slab this is.
    #[getter]
    fn index(&self) -> usize {
        self.index
    }

    fn __repr__(&self) -> String {
        format!("SlabSlot({})", self.index)
    }
}

/// A Python callable the snapshot calls (with the GIL) before it reads any
/// tensor: it returns once the device-to-host copies have landed.
#[derive(Debug)]
pub struct PyReady(pub Py<PyAny>);

impl Ready for PyReady {
    fn wait(&self) -> ckpt_core::Result<()> {
        Python::try_attach(|py| {
            self.0.call0(py).map(|_| ()).map_err(|e| {
                let ty = e
                    .get_type(py)
                    .name()
                    .map(|n| n.to_string())
                    .unwrap_or_else(|_| "Exception".into());
                Error::Internal(format!(
                    "the device-to-host copy of the snapshot failed: {ty}: {}",
                    e.value(py)
                ))
            })
        })
        .unwrap_or_else(|| {
            Err(Error::Internal(
                "the Python interpreter is shutting down".into(),
            ))
        })
    }
}
