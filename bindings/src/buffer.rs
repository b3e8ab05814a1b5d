//! Tensor bytes across the boundary, through the buffer protocol.
//!
//! Saving: [`PySource`] is a [`CopySource`] over any C-contiguous Python buffer
//! (a numpy array, a byte view of a torch tensor, a pinned host buffer). It
//! keeps the exporting object alive and copies without the GIL, so eager mode
//! copies exactly once, into the engine's staging pool, and lazy mode copies on
//! a background thread until `wait_snapshot()`.
//!
//! Loading: [`TensorBuffer`] owns the loaded bytes and exports them as a
//! writable buffer, so `numpy.frombuffer` / `torch.frombuffer` wrap them without
//! a copy (the bytes are moved out of the engine's `Bytes` when nobody else
//! holds them, and copied once otherwise).

use std::os::raw::c_int;

use bytes::{Bytes, BytesMut};
use ckpt_core::CopySource;
use pyo3::buffer::PyUntypedBuffer;
use pyo3::exceptions::PyBufferError;
use pyo3::ffi;
use pyo3::prelude::*;

use crate::errors::invalid;

/// A C-contiguous export of a Python object's buffer, held (and with it the
/// exporting object) until dropped; released with the GIL when dropped.
#[derive(Debug)]
pub struct Export {
    _buf: PyUntypedBuffer,
    /// Address of the first byte.
    pub ptr: usize,
    /// Length in bytes.
    pub len: usize,
}

impl Export {
    /// Take the buffer of `obj` (for tensor `name`, in errors); `writable`
    /// refuses a read-only one.
    pub fn take(obj: &Bound<'_, PyAny>, name: &str, writable: bool) -> PyResult<Self> {
        let buf = PyUntypedBuffer::get(obj)
            .map_err(|e| invalid(format!("tensor `{name}`: not a buffer ({e})")))?;
        if writable && buf.readonly() {
            return Err(invalid(format!(
                "tensor `{name}`: the destination buffer is read-only"
            )));
        }
        if !buf.is_c_contiguous() {
            return Err(invalid(format!(
                "tensor `{name}`: buffer is not C-contiguous"
            )));
        }
        let (ptr, len) = (buf.buf_ptr() as usize, buf.len_bytes());
        Ok(Export {
            _buf: buf,
            ptr,
            len,
        })
    }
}

/// A C-contiguous Python buffer that a snapshot copies from.
#[derive(Debug)]
pub struct PySource {
    // Holds the export until the copy is done (the snapshot drops this source).
    export: Export,
}

impl PySource {
    /// Take a buffer of `obj`; it must be C-contiguous.
    pub fn new(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<Self> {
        Export::take(obj, name, false).map(|export| PySource { export })
    }

    /// The exported memory, as (address, length): two tensors with the same
    /// memory (a tied weight) are the same source and are copied once.
    pub fn span(&self) -> (usize, usize) {
        (self.export.ptr, self.export.len)
    }
}

impl CopySource for PySource {
    fn len(&self) -> usize {
        self.export.len
    }

    fn copy_into(&self, dst: &mut [u8]) -> ckpt_core::Result<()> {
        // SAFETY: the export is held by `self`, so its bytes stay mapped; the
        // caller of save promised not to write them until the snapshot is done.
        unsafe { copy_span(self.export.ptr, self.export.len, dst) }
    }

    fn splits(&self) -> bool {
        true
    }

    fn copy_range_into(&self, offset: usize, dst: &mut [u8]) -> ckpt_core::Result<()> {
        // SAFETY: as in `copy_into`.
        unsafe { copy_part(self.export.ptr, self.export.len, offset, dst) }
    }
}

/// Copy the `len` bytes at `ptr` into `dst`, which must be as long: what a
/// snapshot does with each source of CPU memory ([`PySource`], and
/// `HostSource` in the `host` module).
///
/// # Safety
/// `ptr..ptr + len` is readable memory that nobody writes meanwhile.
pub(crate) unsafe fn copy_span(ptr: usize, len: usize, dst: &mut [u8]) -> ckpt_core::Result<()> {
    if dst.len() != len {
        return Err(ckpt_core::Error::Internal(
            "staging buffer size mismatch".into(),
        ));
    }
    if len > 0 {
        // SAFETY: see the function's contract.
        let src = unsafe { std::slice::from_raw_parts(ptr as *const u8, len) };
        dst.copy_from_slice(src);
    }
    Ok(())
}

/// Copy the `dst.len()` bytes that start `offset` bytes into the `len` bytes
/// at `ptr`: a part of a large source, which a snapshot spreads over threads.
///
/// # Safety
/// As [`copy_span`].
pub(crate) unsafe fn copy_part(
    ptr: usize,
    len: usize,
    offset: usize,
    dst: &mut [u8],
) -> ckpt_core::Result<()> {
    match offset.checked_add(dst.len()) {
        Some(end) if end <= len => {
            // SAFETY: `offset..end` lies within `ptr..ptr + len` (checked).
            unsafe { copy_span(ptr + offset, dst.len(), dst) }
        }
        _ => Err(ckpt_core::Error::Internal(format!(
            "a part of {} bytes at {offset} of a source of {len}",
            dst.len()
        ))),
    }
}

/// Loaded tensor bytes, exported as a writable one-dimensional byte buffer.
///
/// Wrap with `numpy.frombuffer(buf, dtype=...)` or `torch.frombuffer(buf, dtype=...)`:
/// the array shares this memory and keeps this object alive.
#[pyclass(frozen, module = "ckpt._ckpt")]
pub struct TensorBuffer {
    data: BytesMut,
    // Pointer taken from `data` when it was owned mutably; the heap block never moves.
    ptr: usize,
}

/// Export `len` bytes at `ptr`, owned by `owner`, through `view`
/// (`PyBuffer_FillInfo`: format "B", one dimension, a reference to the owner);
/// `readonly` refuses a writable request.
///
/// # Safety
/// `view` comes from Python's buffer protocol, and `ptr..ptr + len` stays
/// valid as long as `owner` lives.
pub unsafe fn export_bytes(
    owner: &Bound<'_, PyAny>,
    view: *mut ffi::Py_buffer,
    ptr: usize,
    len: usize,
    flags: c_int,
    readonly: bool,
) -> PyResult<()> {
    if view.is_null() {
        return Err(PyBufferError::new_err("view is null"));
    }
    // SAFETY: see the function's contract.
    let rc = unsafe {
        ffi::PyBuffer_FillInfo(
            view,
            owner.as_ptr(),
            ptr as *mut std::ffi::c_void,
            len as ffi::Py_ssize_t,
            c_int::from(readonly),
            flags,
        )
    };
    if rc != 0 {
        return Err(PyErr::fetch(owner.py()));
    }
    Ok(())
}

/// Alignment guaranteed to consumers (enough for every dtype, and for SIMD loads).
const ALIGN: usize = 64;

impl TensorBuffer {
    /// Take ownership of loaded bytes (no copy when they are unshared and aligned).
    pub fn new(bytes: Bytes) -> Self {
        let mut data = match bytes.try_into_mut() {
            Ok(m) if (m.as_ptr() as usize) % ALIGN == 0 || m.is_empty() => m,
            Ok(m) => aligned_copy(&m),
            Err(b) => aligned_copy(&b),
        };
        let ptr = data.as_mut_ptr() as usize;
        TensorBuffer { data, ptr }
    }
}

/// Copy into a fresh buffer whose start is `ALIGN`-aligned.
fn aligned_copy(src: &[u8]) -> BytesMut {
    let mut m = BytesMut::with_capacity(src.len() + ALIGN);
    let pad = (ALIGN - (m.as_ptr() as usize) % ALIGN) % ALIGN;
    m.resize(pad, 0);
    m.extend_from_slice(src);
    m.split_off(pad)
}

#[pymethods]
impl TensorBuffer {
    fn __len__(&self) -> usize {
        self.data.len()
    }

    fn __repr__(&self) -> String {
        format!("TensorBuffer({} bytes)", self.data.len())
    }

    unsafe fn __getbuffer__(
        slf: Bound<'_, Self>,
        view: *mut ffi::Py_buffer,
        flags: c_int,
    ) -> PyResult<()> {
        let (ptr, len) = (slf.get().ptr, slf.get().data.len());
        // SAFETY: the bytes live as long as `slf`, which the view owns.
        unsafe { export_bytes(slf.as_any(), view, ptr, len, flags, false) }
    }

    unsafe fn __releasebuffer__(&self, _view: *mut ffi::Py_buffer) {}
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loaded_bytes_are_aligned_and_unchanged() {
        let data: Vec<u8> = (0..=255u8).cycle().take(10_000).collect();
        let whole = Bytes::from(data.clone());
        // An unaligned slice of a shared buffer is copied to an aligned one.
        let shared = whole.slice(3..9_003);
        let buf = TensorBuffer::new(shared.clone());
        assert_eq!(buf.ptr % ALIGN, 0);
        assert_eq!(&buf.data[..], &data[3..9_003]);
        assert_eq!(buf.ptr, buf.data.as_ptr() as usize);
        // Empty data is fine.
        assert_eq!(TensorBuffer::new(Bytes::new()).data.len(), 0);
    }

    #[test]
    fn a_span_is_copied_whole_and_only_into_as_many_bytes() {
        let data: Vec<u8> = (0..64u8).collect();
        let ptr = data.as_ptr() as usize + 8;
        let mut dst = [0u8; 16];
        // SAFETY: the bytes are this test's own, alive throughout.
        unsafe { copy_span(ptr, 16, &mut dst) }.unwrap();
        assert_eq!(&dst[..], &data[8..24]);
        let mut wrong = [0u8; 15];
        assert!(unsafe { copy_span(ptr, 16, &mut wrong) }.is_err());
        // An empty span reads nothing, wherever it points.
        unsafe { copy_span(0, 0, &mut []) }.unwrap();
    }

    #[test]
    fn unique_aligned_bytes_are_not_copied() {
        let mut v = aligned_copy(&[7u8; 4096]);
        let ptr = v.as_mut_ptr() as usize;
        let buf = TensorBuffer::new(v.freeze());
        assert_eq!(buf.ptr, ptr, "moved, not copied");
    }
}
