//! `MemoryRoot`: a checkpoint root on a local directory as the memory tier
//! handles it, over `ckpt_core::layout::LocalRoot` (keys, step names and the
//! manifest schema stay in Rust). File I/O runs with the GIL released.

use std::collections::BTreeMap;
use std::path::PathBuf;

use ckpt_core::layout::local_root::{self, checkpoint_id, LocalRoot};
use pyo3::buffer::PyUntypedBuffer;
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use crate::errors::{invalid, IntoPyResult};
use crate::runtime;

/// A checkpoint root on a local directory (created if missing); writes stage
/// their bytes under `incoming`, on the same file system.
#[pyclass(frozen, name = "MemoryRoot", module = "ckpt._ckpt")]
pub struct MemoryRoot {
    root: LocalRoot,
}

/// A C-contiguous buffer of `obj` as (address, length), held while `buf` lives.
fn span(obj: &Bound<'_, PyAny>, writable: bool) -> PyResult<(PyUntypedBuffer, usize, usize)> {
    let buf = PyUntypedBuffer::get(obj).map_err(|e| invalid(format!("not a buffer ({e})")))?;
    if writable && buf.readonly() {
        return Err(invalid("the buffer is read-only"));
    }
    if !buf.is_c_contiguous() {
        return Err(invalid("the buffer is not C-contiguous"));
    }
    let (ptr, len) = (buf.buf_ptr() as usize, buf.len_bytes());
    Ok((buf, ptr, len))
}

#[pymethods]
impl MemoryRoot {
    #[new]
    fn new(py: Python<'_>, path: PathBuf, incoming: PathBuf) -> PyResult<Self> {
        let root = py.detach(|| LocalRoot::open(path, incoming)).py()?;
        Ok(MemoryRoot { root })
    }

    /// The root's directory (absolute).
    #[getter]
    fn path(&self) -> PathBuf {
        self.root.path().to_owned()
    }

    /// Where writes stage their bytes.
    #[getter]
    fn incoming(&self) -> PathBuf {
        self.root.incoming().to_owned()
    }

    /// The root as a store URL (`file://...`).
    #[getter]
    fn url(&self) -> PyResult<String> {
        self.root.url().py()
    }

    /// Committed checkpoints: step -> attempt (the last attempt by name, were
    /// there two of one step).
    fn committed(&self, py: Python<'_>) -> PyResult<BTreeMap<u64, String>> {
        let ids = py.detach(|| self.root.committed()).py()?;
        Ok(ids.into_iter().map(|id| (id.step, id.attempt)).collect())
    }

    /// The key of the manifest of `(step, attempt)`.
    #[staticmethod]
    fn manifest_key(step: u64, attempt: &str) -> PyResult<String> {
        Ok(local_root::manifest_key(
            &checkpoint_id(step, attempt).py()?,
        ))
    }

    /// Which rank of how many saved a checkpoint (as the memory tier's saves
    /// record it); `None` when unreadable or not recorded.
    fn identity(&self, py: Python<'_>, step: u64, attempt: &str) -> PyResult<Option<(u64, u64)>> {
        let id = checkpoint_id(step, attempt).py()?;
        Ok(py.detach(|| self.root.identity(&id)))
    }

    /// Every object of a checkpoint with its length, the manifest last.
    fn objects(&self, py: Python<'_>, step: u64, attempt: &str) -> PyResult<Vec<(String, u64)>> {
        let id = checkpoint_id(step, attempt).py()?;
        py.detach(|| self.root.objects(&id)).py()
    }

    /// The objects a stored manifest references (unverified): chunks with
    /// their stored lengths, then per-checkpoint objects (length `None`).
    #[staticmethod]
    fn references(manifest: &[u8]) -> PyResult<Vec<(String, Option<u64>)>> {
        ckpt_core::Manifest::decode_unverified(manifest, "manifest")
            .and_then(|m| local_root::references(&m))
            .py()
    }

    /// Hard-link every object of a checkpoint under `into` (same keys), so
    /// retention here cannot remove what a replication still sends; its
    /// objects there, or `None` when the checkpoint is already retired.
    fn pin(
        &self,
        py: Python<'_>,
        step: u64,
        attempt: &str,
        into: PathBuf,
    ) -> PyResult<Option<Vec<(String, u64)>>> {
        let id = checkpoint_id(step, attempt).py()?;
        py.detach(|| self.root.pin(&id, &into)).py()
    }

    /// The stored length of `key`, or `None` when it is not there.
    fn size(&self, py: Python<'_>, key: &str) -> PyResult<Option<u64>> {
        py.detach(|| self.root.size(key)).py()
    }

    /// True when `key` is there with `size` bytes.
    fn has(&self, py: Python<'_>, key: &str, size: u64) -> PyResult<bool> {
        py.detach(|| self.root.has(key, size)).py()
    }

    /// The bytes of `key`, or `None` when it is gone or unreadable.
    fn read<'py>(&self, py: Python<'py>, key: &str) -> PyResult<Option<Bound<'py, PyBytes>>> {
        let data = py.detach(|| self.root.read(key)).py()?;
        Ok(data.map(|d| PyBytes::new(py, &d)))
    }

    /// Fill the writable buffer `out` with the bytes of `key`; False when the
    /// object is gone, unreadable or not `len(out)` bytes long.
    fn read_into(&self, py: Python<'_>, key: &str, out: &Bound<'_, PyAny>) -> PyResult<bool> {
        let (buf, ptr, len) = span(out, true)?;
        // SAFETY: the export `buf` keeps the memory alive and in place until
        // it is dropped, after this call.
        let dst = unsafe { std::slice::from_raw_parts_mut(ptr as *mut u8, len) };
        let got = py.detach(|| self.root.read_into(key, dst)).py();
        drop(buf);
        got
    }

    /// Write `key` whole or not at all (staged, fsynced, renamed into place).
    fn write(&self, py: Python<'_>, key: &str, data: &Bound<'_, PyAny>) -> PyResult<()> {
        let (buf, ptr, len) = span(data, false)?;
        // SAFETY: as in `read_into`.
        let src = unsafe { std::slice::from_raw_parts(ptr as *const u8, len) };
        let done = py.detach(|| self.root.write(key, src)).py();
        drop(buf);
        done
    }

    /// Write a manifest (verified first) under its own key, after every object
    /// it references: the commit. Returns its `(step, attempt)`.
    fn write_manifest(&self, py: Python<'_>, manifest: &[u8]) -> PyResult<(u64, String)> {
        let id = py.detach(|| self.root.write_manifest(manifest)).py()?;
        Ok((id.step, id.attempt))
    }

    /// Make `key` of `other` an object of this root too (a hard link, else a copy).
    fn link_from(&self, py: Python<'_>, other: &MemoryRoot, key: &str) -> PyResult<()> {
        py.detach(|| self.root.link_from(&other.root, key)).py()
    }

    /// Uncommit a checkpoint (its manifest goes).
    #[pyo3(name = "drop")]
    fn drop_checkpoint(&self, py: Python<'_>, step: u64, attempt: &str) -> PyResult<()> {
        let id = checkpoint_id(step, attempt).py()?;
        py.detach(|| self.root.drop_checkpoint(&id)).py()
    }

    /// Uncommit every checkpoint newer than `step` (every one, for a step
    /// below 0: nothing was resumed).
    fn drop_newer(&self, py: Python<'_>, step: i64) -> PyResult<()> {
        py.detach(|| match u64::try_from(step) {
            Ok(step) => self.root.drop_newer(step),
            Err(_) => self
                .root
                .committed()?
                .iter()
                .try_for_each(|id| self.root.drop_checkpoint(id)),
        })
        .py()
    }

    /// Retention by the engine's own GC: the newest `keep`, and no chunk or
    /// leftover that no kept manifest references.
    fn gc(&self, py: Python<'_>, keep: usize) -> PyResult<()> {
        let root = self.root.clone();
        runtime::wait(py, move || async move { root.retain(keep).await })?.py()?;
        Ok(())
    }

    fn __repr__(&self) -> String {
        format!("MemoryRoot({:?})", self.root.path())
    }
}
