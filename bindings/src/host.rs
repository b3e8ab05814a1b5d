//! CPU tensors that a loop saves again and again, taken by their storages.
//!
//! The walk of a state hands each CPU tensor to `save` as a numpy view of its
//! bytes, and the engine takes each view through the buffer protocol. Both
//! cost more than the rest of a planned save's work per tensor: half a
//! microsecond for `Tensor.numpy()` in Python, and a boxed `Py_buffer` (with
//! numpy's shape and format info) in the engine, freed by the copy thread.
//!
//! A loop's later saves of the same mapping (`ckpt._save.repeat_host`) know each
//! tensor's name, dtype, shape and address already. A [`HostRun`] keeps the
//! first three, made once from the specs of the save that walked the mapping;
//! each later save gives it the tensors' storages (`Tensor.untyped_storage()`,
//! a few tens of nanoseconds each) and addresses, and it makes every spec in
//! one call. A spec's bytes are a [`HostSpan`]: the address and length of the
//! tensor's bytes, checked to lie inside its storage, and the storage, held
//! until the snapshot has copied them. Holding the storage, not the tensor,
//! is what keeps the memory: a tensor given other memory (`set_`, `.data =`)
//! does not free the old while a span holds its storage.

use std::os::raw::c_int;

use ckpt_core::{CopySource, DType};
use pyo3::ffi;
use pyo3::intern;
use pyo3::prelude::*;

use crate::args::{Shard, TensorSpec};
use crate::buffer::{copy_part, copy_span, export_bytes};
use crate::errors::{invalid, IntoPyResult};

/// The bytes of a CPU tensor: `len` bytes at `ptr`, inside the memory of the
/// storage it holds, checked against the storage when made. A save's spans
/// ([`HostRun::specs`]) are read-only buffers (one dimension of bytes) for
/// anything in Python that reads a spec's data; a restore's
/// ([`HostSpan::writable`]) are the writable destinations of a load.
#[pyclass(frozen, module = "ckpt._ckpt")]
pub struct HostSpan {
    storage: Py<PyAny>,
    ptr: usize,
    len: usize,
    writable: bool,
}

#[pymethods]
impl HostSpan {
    /// The `len` bytes at `ptr` of `storage` (torch's `UntypedStorage`, or
    /// any object with `data_ptr()` and `nbytes()`), as a writable buffer: a
    /// load's destination in a live CPU tensor's memory, made without the
    /// numpy byte view that cost two microseconds a tensor (a fifth of a
    /// restore's walk of a model of thousands of small tensors).
    /// `InvalidInputError` where the bytes do not lie inside the storage.
    #[staticmethod]
    fn writable(
        py: Python<'_>,
        storage: Bound<'_, PyAny>,
        ptr: usize,
        len: usize,
    ) -> PyResult<Self> {
        if len > 0 {
            inside(py, &storage, ptr, len, "a load's destination")?;
        }
        Ok(HostSpan {
            storage: storage.unbind(),
            ptr,
            len,
            writable: true,
        })
    }

    fn __len__(&self) -> usize {
        self.len
    }

    /// Length in bytes.
    #[getter]
    fn nbytes(&self) -> usize {
        self.len
    }

    fn __repr__(&self) -> String {
        format!("HostSpan({} bytes)", self.len)
    }

    unsafe fn __getbuffer__(
        slf: Bound<'_, Self>,
        view: *mut ffi::Py_buffer,
        flags: c_int,
    ) -> PyResult<()> {
        let (ptr, len, writable) = (slf.get().ptr, slf.get().len, slf.get().writable);
        // SAFETY: the span lies in the storage's memory (checked when made),
        // which the storage keeps, and the span keeps the storage; the view
        // owns a reference to the span. A save's span is read-only: a
        // writable request fails.
        unsafe { export_bytes(slf.as_any(), view, ptr, len, flags, !writable) }
    }

    unsafe fn __releasebuffer__(&self, _view: *mut ffi::Py_buffer) {}
}

impl HostSpan {
    /// The engine's source over these bytes (it holds the storage too).
    pub fn source(&self, py: Python<'_>) -> HostSource {
        HostSource {
            storage: Some(self.storage.clone_ref(py)),
            ptr: self.ptr,
            len: self.len,
        }
    }
}

/// A [`HostSpan`]'s bytes as the snapshot copies them, with its storage held
/// until the copy is done; the reference is dropped with the GIL, at once, so
/// that the loop's memory is not kept past the copy.
pub struct HostSource {
    storage: Option<Py<PyAny>>,
    ptr: usize,
    len: usize,
}

impl HostSource {
    /// The memory, as (address, length): tied tensors share one source.
    pub fn span(&self) -> (usize, usize) {
        (self.ptr, self.len)
    }
}

impl CopySource for HostSource {
    fn len(&self) -> usize {
        self.len
    }

    fn copy_into(&self, dst: &mut [u8]) -> ckpt_core::Result<()> {
        // SAFETY: the bytes lie in the storage's memory (checked when the
        // span was made) and the storage is held; the caller of save
        // promised not to write them until the snapshot is done.
        unsafe { copy_span(self.ptr, self.len, dst) }
    }

    fn splits(&self) -> bool {
        true
    }

    fn copy_range_into(&self, offset: usize, dst: &mut [u8]) -> ckpt_core::Result<()> {
        // SAFETY: as in `copy_into`.
        unsafe { copy_part(self.ptr, self.len, offset, dst) }
    }
}

impl Drop for HostSource {
    fn drop(&mut self) {
        if let Some(s) = self.storage.take() {
            Python::attach(move |_| drop(s));
        }
    }
}

/// One tensor of a [`HostRun`]: what every save of it repeats.
struct Entry {
    name: String,
    dtype: DType,
    shape: Vec<u64>,
    shard: Option<Py<Shard>>,
    len: usize,
}

/// The specs of a run of CPU tensors that a loop saves again and again,
/// less their bytes: made once from the specs of the save that walked them,
/// it makes each later save's specs in one call (see the module docs).
#[pyclass(frozen, module = "ckpt._ckpt")]
pub struct HostRun {
    entries: Vec<Entry>,
}

#[pymethods]
impl HostRun {
    /// From the walk's specs of the tensors, in order.
    #[new]
    fn new(py: Python<'_>, specs: Vec<Bound<'_, TensorSpec>>) -> PyResult<Self> {
        let entries = specs
            .iter()
            .map(|s| {
                let s = s.get();
                let numel = ckpt_core::numel(&s.shape).py()?;
                let len = usize::try_from(s.dtype.byte_len(numel).py()?)
                    .map_err(|_| invalid(format!("tensor `{}`: too large", s.name)))?;
                Ok(Entry {
                    name: s.name.clone(),
                    dtype: s.dtype,
                    shape: s.shape.clone(),
                    shard: s.shard.as_ref().map(|x| x.clone_ref(py)),
                    len,
                })
            })
            .collect::<PyResult<_>>()?;
        Ok(HostRun { entries })
    }

    fn __len__(&self) -> usize {
        self.entries.len()
    }

    /// The specs of this save: one per tensor, over `ptrs[i]` in the memory
    /// of `storages[i]` (objects with `data_ptr()` and `nbytes()`, as torch's
    /// `UntypedStorage`), copied at once where `copy_now[i]`.
    /// `InvalidInputError` where the lists' lengths differ from the run's, or
    /// a tensor's bytes do not lie inside its storage's memory.
    fn specs(
        &self,
        py: Python<'_>,
        storages: Vec<Bound<'_, PyAny>>,
        ptrs: Vec<usize>,
        copy_now: Vec<bool>,
    ) -> PyResult<Vec<TensorSpec>> {
        let n = self.entries.len();
        if storages.len() != n || ptrs.len() != n || copy_now.len() != n {
            return Err(invalid(format!(
                "a run of {n} tensors was given {} storages, {} addresses and {} copy flags",
                storages.len(),
                ptrs.len(),
                copy_now.len()
            )));
        }
        let mut out = Vec::with_capacity(n);
        for (((e, storage), ptr), now) in self.entries.iter().zip(storages).zip(ptrs).zip(copy_now)
        {
            if e.len > 0 {
                inside(py, &storage, ptr, e.len, &format!("tensor `{}`", e.name))?;
            }
            let span = HostSpan {
                storage: storage.unbind(),
                ptr,
                len: e.len,
                writable: false,
            };
            out.push(TensorSpec {
                name: e.name.clone(),
                dtype: e.dtype,
                shape: e.shape.clone(),
                data: Py::new(py, span)?.into_any(),
                copy_now: now,
                shard: e.shard.as_ref().map(|x| x.clone_ref(py)),
            });
        }
        Ok(out)
    }
}

/// `InvalidInputError` unless the `len` bytes at `ptr` lie inside the memory
/// of `storage` (its `data_ptr()` and `nbytes()`); `what` names them.
fn inside(
    py: Python<'_>,
    storage: &Bound<'_, PyAny>,
    ptr: usize,
    len: usize,
    what: &str,
) -> PyResult<()> {
    let ask = |name: &Bound<'_, pyo3::types::PyString>| {
        storage
            .call_method0(name)
            .and_then(|v| v.extract::<usize>())
            .map_err(|err| invalid(format!("{what}: its storage's {name}(): {err}")))
    };
    let (base, size) = (ask(intern!(py, "data_ptr"))?, ask(intern!(py, "nbytes"))?);
    let fits = ptr >= base
        && ptr
            .checked_add(len)
            .zip(base.checked_add(size))
            .is_some_and(|(end, limit)| end <= limit);
    if !fits {
        return Err(invalid(format!(
            "{what}: {len} bytes at {ptr:#x} are not inside its storage ({size} bytes at {base:#x})"
        )));
    }
    Ok(())
}
