//! Caller memory that a load writes into, through the buffer protocol.
//!
//! [`PyDest`] holds a writable, C-contiguous buffer of a Python object (a
//! numpy byte view of a live torch tensor, a DTensor's local shard, a numpy
//! array) for the length of one load, so the engine decodes straight into the
//! memory the training loop uses: no intermediate copy of the state.

use pyo3::prelude::*;

use crate::buffer::Export;

/// A writable C-contiguous Python buffer a load fills.
#[derive(Debug)]
pub struct PyDest {
    // Keeps the export (and the exporting object) alive while the load runs.
    export: Export,
}

impl PyDest {
    /// Take a writable buffer of `obj` (for the tensor `name`, in errors).
    pub fn new(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<Self> {
        Export::take(obj, name, true).map(|export| PyDest { export })
    }

    /// Address and length, to rebuild the slice on the runtime.
    pub fn raw(&self) -> (usize, usize) {
        (self.export.ptr, self.export.len)
    }
}

/// The bytes at `(ptr, len)` as a mutable slice.
///
/// # Safety
/// `(ptr, len)` must come from a [`PyDest`] that outlives the slice, no two
/// live slices may overlap, and nothing else may access the memory meanwhile
/// (the caller of a load hands the tensors over for its duration).
pub unsafe fn slice_mut<'a>((ptr, len): (usize, usize)) -> &'a mut [u8] {
    if len == 0 {
        return &mut [];
    }
    // SAFETY: see above.
    unsafe { std::slice::from_raw_parts_mut(ptr as *mut u8, len) }
}
