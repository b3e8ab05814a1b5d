//! The `Checkpointer` class: a thin shell over `ckpt_core::Checkpointer`.
//!
//! Tensors arrive already flattened by the Python glue, as
//! [`TensorSpec`]s plus a metadata tree whose tensor leaves are
//! [`TensorRef`](crate::value::TensorRef)s; loads hand back the same shape of
//! data with [`TensorBuffer`]s, or fill [`LoadTarget`]s in place. Every wait
//! releases the GIL.

use std::collections::HashMap;
use std::mem::ManuallyDrop;
use std::sync::Arc;
use std::time::Duration;

use ckpt_core::BoxTarget;
use ckpt_core::{
    BusyPolicy, Capture, CheckpointId, CheckpointerOptions, Compression, CopySource, Error, Key,
    Loaded, Retention, SnapshotMode, SourceTensor, Status, Tensor, TensorData, Value,
};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList, PyTuple};

use crate::args::{LoadTarget, SnapshotBytes, TensorSpec};
use crate::buffer::{PySource, TensorBuffer};
use crate::coord::PyCoordinator;
use crate::dest::{slice_mut, PyDest};
use crate::errors::{invalid, to_py, IntoPyResult};
use crate::handle::SaveHandle;
use crate::host::HostSpan;
use crate::results::{GcReport, TensorInfo};
use crate::runtime::{self, check_pid};
use crate::slab::{HostSlab, PyReady, SlabSlot};
use crate::value::{from_value, to_value};
use ckpt_core::store::CountingStore;

/// Saves and loads checkpoints under one root URL (`file:///dir`, `memory://name`).
#[pyclass(frozen, module = "ckpt._ckpt")]
pub struct Checkpointer {
    inner: ManuallyDrop<ckpt_core::Checkpointer>,
    // The store as the engine sees it, counting what passes (see `io_counts`).
    counting: Arc<CountingStore>,
    pid: u32,
    lazy: bool,
}

impl Drop for Checkpointer {
    fn drop(&mut self) {
        // In a fork child the parent's engine state (locks, tasks) is not ours
        // to tear down: leak it instead.
        if self.pid == std::process::id() {
            // SAFETY: dropped exactly once, here.
            unsafe { ManuallyDrop::drop(&mut self.inner) }
        }
    }
}

fn parse_compression(compression: Option<&str>, level: i32) -> PyResult<Compression> {
    match compression {
        None | Some("none") => Ok(Compression::None),
        Some("zstd") => Ok(Compression::Zstd(level)),
        Some(other) => Err(invalid(format!(
            "unknown compression `{other}` (use None or \"zstd\")"
        ))),
    }
}

impl Checkpointer {
    fn core(&self) -> PyResult<&ckpt_core::Checkpointer> {
        check_pid(self.pid, "Checkpointer")?;
        Ok(&self.inner)
    }

    fn resolve(
        &self,
        py: Python<'_>,
        step: u64,
        attempt: Option<String>,
    ) -> PyResult<CheckpointId> {
        if let Some(attempt) = attempt {
            return Ok(CheckpointId { step, attempt });
        }
        let cp = self.core()?.clone();
        let ids = runtime::wait(py, move || async move { cp.committed().await })
            .and_then(IntoPyResult::py)?;
        ids.into_iter()
            .rev()
            .find(|id| id.step == step)
            .ok_or_else(|| {
                to_py(Error::NotFound {
                    what: format!("checkpoint of step {step}"),
                })
            })
    }
}

#[pymethods]
impl Checkpointer {
    #[new]
    #[pyo3(signature = (url, *, keep_last=None, keep_every=None, compression=None, level=3, lazy=false,
                        staging_budget=None, busy="wait", format="native", coordinator=None,
                        collective_timeout=600.0, read_only=false, fencing=true, gc_grace=60.0,
                        direct_io=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        url: String,
        keep_last: Option<usize>,
        keep_every: Option<u64>,
        compression: Option<&str>,
        level: i32,
        lazy: bool,
        staging_budget: Option<u64>,
        busy: &str,
        format: &str,
        coordinator: Option<Bound<'_, PyAny>>,
        collective_timeout: f64,
        read_only: bool,
        fencing: bool,
        gc_grace: f64,
        direct_io: Option<bool>,
    ) -> PyResult<Self> {
        let gc_grace = Duration::try_from_secs_f64(gc_grace).map_err(|_| {
            invalid(format!(
                "gc_grace must be a number of seconds >= 0, not {gc_grace}"
            ))
        })?;
        if keep_last == Some(0) {
            return Err(invalid("keep_last must be at least 1"));
        }
        let collective_timeout = Duration::try_from_secs_f64(collective_timeout)
            .ok()
            .filter(|t| !t.is_zero())
            .ok_or_else(|| {
                invalid(format!(
                    "collective_timeout must be a positive number of seconds, not {collective_timeout}"
                ))
            })?;
        let busy = match busy {
            "wait" => BusyPolicy::Wait,
            "skip" => BusyPolicy::Skip,
            other => {
                return Err(invalid(format!(
                    "busy must be \"wait\" or \"skip\", not `{other}`"
                )))
            }
        };
        let options = CheckpointerOptions {
            collective_timeout,
            read_only,
            fencing,
            gc_grace,
            ..CheckpointerOptions::default()
        };
        // Local directories: large puts with O_DIRECT unless `direct_io=False`
        // (None: the default, on); CKPT_DIRECT_IO still overrides either.
        let mut store_opts = ckpt_core::store::StoreOptions::default();
        if direct_io == Some(false) {
            store_opts.local_dir.direct_min_bytes = None;
        }
        let counting = Arc::new(CountingStore::new(
            ckpt_core::store::open_url_with(&url, &store_opts).py()?,
        ));
        let caps = ckpt_core::store::Capabilities::of_url(&url);
        let mut builder = ckpt_formats::builder(url)
            .store(counting.clone())
            .capabilities(caps)
            .options(options)
            .format(ckpt_formats::by_name(format).py()?)
            .retention(Retention {
                keep_last,
                keep_every,
            })
            .compression(parse_compression(compression, level)?)
            .snapshot(if lazy {
                SnapshotMode::Lazy
            } else {
                SnapshotMode::Eager
            })
            .busy(busy);
        if let Some(b) = staging_budget {
            builder = builder.staging_budget(b);
        }
        if let Some(c) = coordinator.filter(|c| !c.is_none()) {
            builder = builder.coordinator(PyCoordinator::new(&c)?);
        }
        let inner = runtime::wait(py, move || builder.build()).and_then(IntoPyResult::py)?;
        Ok(Checkpointer {
            inner: ManuallyDrop::new(inner),
            counting,
            pid: std::process::id(),
            lazy,
        })
    }

    /// The URL this checkpointer was opened on.
    #[getter]
    fn url(&self) -> &str {
        self.inner.url()
    }

    /// This process's rank in the job (0 without a coordinator).
    #[getter]
    fn rank(&self) -> usize {
        self.inner.rank()
    }

    /// Number of ranks of the job (1 without a coordinator).
    #[getter]
    fn world_size(&self) -> usize {
        self.inner.world_size()
    }

    /// True when snapshots are lazy (copied in the background after `save` returned).
    #[getter]
    fn lazy(&self) -> bool {
        self.lazy
    }

    /// Start saving a checkpoint of `step`.
    ///
    /// `tensors` are [`TensorSpec`]s; a spec's `data` is any C-contiguous
    /// buffer of exactly the tensor's bytes, or a `SlabSlot` (host memory the
    /// glue fills, saved without a copy). Tensors with `copy_now` are copied
    /// before this returns even in lazy mode (memory that changes before the
    /// optimizer step, e.g. batch-norm statistics).
    /// `meta` is plain data with `TensorRef` leaves. `ready`, if given, is
    /// called (on a background thread in lazy mode) before any tensor is read:
    /// it returns once copies still landing in slab slots are done.
    /// `share`: the save keeps its snapshot for another checkpointer's save
    /// of the same tensors (eager: `SaveHandle.snapshot_specs`; lazy:
    /// `save_after`).
    #[pyo3(signature = (step, tensors, meta, ready=None, share=false))]
    fn save(
        &self,
        py: Python<'_>,
        step: u64,
        tensors: Vec<Bound<'_, TensorSpec>>,
        meta: Bound<'_, PyAny>,
        ready: Option<Py<PyAny>>,
        share: bool,
    ) -> PyResult<SaveHandle> {
        let cp = self.core()?.clone();
        let meta = to_value(&meta)?;
        // A lazy shared save's `save_after` reuses its state tree (converting
        // it from Python again cost about as much as this whole call).
        let keep = (share && self.lazy)
            .then(|| state_of(&meta).cloned())
            .flatten();
        let out = sources(py, &tensors)?;
        let capture = Capture {
            tensors: out,
            meta,
            ready: ready.map(|f| Arc::new(PyReady(f)) as Arc<dyn ckpt_core::Ready>),
        };
        let rt = runtime::runtime(py)?;
        let (handle, taken) = runtime::wait(py, move || async move {
            if share {
                cp.save_shared(step, capture)
                    .await
                    .map(|(h, s)| (h, Some(s)))
            } else {
                cp.save(step, capture).await.map(|h| (h, None))
            }
        })
        .and_then(IntoPyResult::py)?;
        Ok(SaveHandle::spawn(&rt, handle, taken).keep_state(keep))
    }

    /// Save `step` as another checkpointer's lazy save made with `share=True`
    /// (`first`) snapshots it: its tensors, from its staging copies once
    /// they are taken (nothing is copied twice), and `meta`. Returns at once;
    /// this save's snapshot is done when `first`'s is, and fails with its
    /// error. A save's snapshot is given once: `InvalidInputError` if `first`
    /// is eager, unshared, or already given. A `meta` mapping without a
    /// `state` key gets `first`'s `state`, as converted for it.
    fn save_after(
        &self,
        py: Python<'_>,
        step: u64,
        first: &SaveHandle,
        meta: Bound<'_, PyAny>,
    ) -> PyResult<SaveHandle> {
        let cp = self.core()?.clone();
        let mut meta = to_value(&meta)?;
        if let Value::Map(entries) = &mut meta {
            if state_of_entries(entries).is_none() {
                if let Some(state) = first.take_state() {
                    entries.push((Key::Str("state".into()), state));
                }
            }
        }
        let later = first.take_later()?.ok_or_else(|| {
            to_py(Error::InvalidInput(
                "save_after needs a lazy save made with share=True whose snapshot was not given yet"
                    .into(),
            ))
        })?;
        let rt = runtime::runtime(py)?;
        let handle = runtime::wait(py, move || async move {
            cp.save_snapshot(step, meta, later).await
        })
        .and_then(IntoPyResult::py)?;
        Ok(SaveHandle::spawn(&rt, handle, None))
    }

    /// Ready the staging memory of a save of these tensors (the specs a walk
    /// made, as `save` takes them; what it would copy, each memory span once):
    /// mapped, its pages faulted in now by a background thread
    /// (at its lowered priority), not in that save's copy. Best effort within
    /// the staging budget; returns the bytes readied. Blocks, with the GIL
    /// released, for about as long as a first copy of those bytes would
    /// take: call it off the training thread. `also`: the byte lengths of
    /// further tensors the save will copy that do not exist yet (an
    /// optimizer's state before its first step).
    #[pyo3(signature = (tensors, also=Vec::new()))]
    fn ready_staging(
        &self,
        py: Python<'_>,
        tensors: Vec<Bound<'_, TensorSpec>>,
        also: Vec<usize>,
    ) -> PyResult<u64> {
        let cp = self.core()?.clone();
        let mut lens = Capture {
            tensors: sources(py, &tensors)?,
            meta: Value::Null,
            ready: None,
        }
        .copy_lens();
        lens.extend(also);
        runtime::wait(py, move || async move { cp.ready_staging(&lens).await })
            .and_then(IntoPyResult::py)
    }

    /// A zeroed host slab with a slot of each of `lens`, holding its size of
    /// the staging budget until a save lets it go (see `HostSlab`), for the save of
    /// `step`. When the budget is held: with `busy="skip"`, `SkippedError`;
    /// with `"wait"`, blocks (GIL released) until it fits, or, given `since`
    /// (a `staging_returns` reading), returns None once memory came back or a
    /// slab came free after it without room (look for one to reuse), or
    /// after `timeout` seconds.
    #[pyo3(signature = (lens, step, since=None, timeout=None))]
    fn new_slab(
        &self,
        py: Python<'_>,
        lens: Vec<usize>,
        step: u64,
        since: Option<u64>,
        timeout: Option<f64>,
    ) -> PyResult<Option<HostSlab>> {
        let cp = self.core()?.clone();
        let limit = crate::handle::timeout_of(timeout)?;
        let slab = py.detach(|| ckpt_core::Slab::new(&lens)).map_err(to_py)?;
        let bytes = slab.len() as u64;
        let got = runtime::block_on(py, limit, move || async move {
            cp.charge_staging(bytes, step, since).await
        })?;
        let Some((pool, charge)) = got.map(IntoPyResult::py).transpose()? else {
            return Ok(None);
        };
        Ok(charge.map(|c| HostSlab::charged_to(slab, pool, c)))
    }

    /// Charge `slab` (made by `new_slab`, let go of by its last save) to the
    /// staging budget again before a save uses it, under the busy policy:
    /// True once charged (or when it still is, or is charged to no pool);
    /// False when memory came back after `since` without room, or after
    /// `timeout` seconds (look again).
    #[pyo3(signature = (slab, step, since=None, timeout=None))]
    fn charge_slab(
        &self,
        py: Python<'_>,
        slab: &Bound<'_, HostSlab>,
        step: u64,
        since: Option<u64>,
        timeout: Option<f64>,
    ) -> PyResult<bool> {
        let slab = slab.get();
        if slab.pool().is_none() || slab.charged() > 0 {
            return Ok(true);
        }
        let cp = self.core()?.clone();
        let limit = crate::handle::timeout_of(timeout)?;
        let bytes = slab.byte_len() as u64;
        let got = runtime::block_on(py, limit, move || async move {
            cp.charge_staging(bytes, step, since).await
        })?;
        let Some((_, charge)) = got.map(IntoPyResult::py).transpose()? else {
            return Ok(false);
        };
        Ok(match charge {
            Some(c) => {
                slab.recharge(c);
                true
            }
            None => false,
        })
    }

    /// How many times staging memory came back so far (for `new_slab`'s `since`).
    fn staging_returns(&self) -> PyResult<u64> {
        Ok(self.core()?.staging().map_or(0, |p| p.returns()))
    }

    /// Wake the saves waiting in `new_slab`: a slab came free that no save's
    /// release announced (copies let go without a save).
    fn staging_nudge(&self) -> PyResult<()> {
        if let Some(pool) = self.core()?.staging() {
            pool.nudge();
        }
        Ok(())
    }

    /// Bytes of staging memory held idle between saves (reused by the next).
    fn staging_idle_bytes(&self) -> PyResult<u64> {
        Ok(self.core()?.staging_idle_bytes())
    }

    /// Block until every save started so far is committed or failed.
    ///
    /// Raises `CheckpointTimeoutError` after `timeout` seconds.
    #[pyo3(signature = (timeout=None))]
    fn flush(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<()> {
        let cp = self.core()?.clone();
        let limit = crate::handle::timeout_of(timeout)?;
        match runtime::block_on(py, limit, move || async move { cp.flush().await })? {
            Some(()) => Ok(()),
            None => Err(to_py(Error::Timeout(format!(
                "saves still in flight after {} s",
                timeout.unwrap_or(0.0)
            )))),
        }
    }

    /// Load the newest committed, intact checkpoint, or `None`.
    ///
    /// Returns `(step, attempt, tensors, meta, skipped)`: `tensors` maps names to
    /// `(dtype, shape, TensorBuffer)`; `skipped` lists `(step, attempt, error)` of
    /// newer checkpoints that were damaged.
    fn load_latest<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyTuple>>> {
        let cp = self.core()?.clone();
        let loaded = runtime::wait(py, move || async move { cp.load_latest().await })
            .and_then(IntoPyResult::py)?;
        loaded.map(|l| loaded_to_py(py, l)).transpose()
    }

    /// Load the checkpoint of `step` (the newest attempt, unless `attempt` is given).
    #[pyo3(signature = (step, attempt=None))]
    fn load<'py>(
        &self,
        py: Python<'py>,
        step: u64,
        attempt: Option<String>,
    ) -> PyResult<Bound<'py, PyTuple>> {
        let id = self.resolve(py, step, attempt)?;
        let cp = self.core()?.clone();
        let loaded = runtime::wait(py, move || async move { cp.load(&id).await })
            .and_then(IntoPyResult::py)?;
        loaded_to_py(py, loaded)
    }

    /// Load only the named tensors of a checkpoint: `{name: (dtype, shape, TensorBuffer)}`.
    #[pyo3(signature = (step, names, attempt=None))]
    fn load_tensors<'py>(
        &self,
        py: Python<'py>,
        step: u64,
        names: Vec<String>,
        attempt: Option<String>,
    ) -> PyResult<Bound<'py, PyDict>> {
        let id = self.resolve(py, step, attempt)?;
        let cp = self.core()?.clone();
        let tensors = runtime::wait(py, move || async move {
            let names: Vec<&str> = names.iter().map(String::as_str).collect();
            cp.load_tensors(&id, &names).await
        })
        .and_then(IntoPyResult::py)?;
        tensors_to_py(py, tensors)
    }

    /// Load tensors, or boxes of sharded ones, straight into caller buffers.
    ///
    /// Each [`LoadTarget`] is the box of extent `shape` placed by its `shard`
    /// (`None`: the whole tensor of that shape), read into `dest`, a writable
    /// C-contiguous buffer of exactly its bytes. Only stored pieces that overlap
    /// a box are read. Every target is checked against the manifest before
    /// anything is written.
    #[pyo3(signature = (step, attempt, targets))]
    fn load_into(
        &self,
        py: Python<'_>,
        step: u64,
        attempt: String,
        targets: Vec<Bound<'_, LoadTarget>>,
    ) -> PyResult<()> {
        let cp = self.core()?.clone();
        let id = CheckpointId { step, attempt };
        let mut held = Vec::with_capacity(targets.len());
        let mut plan = Vec::with_capacity(targets.len());
        for t in &targets {
            let t = t.get();
            let dest = PyDest::new(t.dest.bind(py), &t.name)?;
            plan.push((
                t.name.clone(),
                t.dtype,
                t.shape.clone(),
                t.spec(),
                dest.raw(),
            ));
            held.push(dest);
        }
        let done = runtime::wait(py, move || async move {
            let targets = plan
                .iter()
                .map(|(name, dtype, shape, spec, raw)| BoxTarget {
                    name,
                    dtype: Some(*dtype),
                    shape: shape.clone(),
                    spec: spec.clone(),
                    // SAFETY: the buffers are held (`held`) until this wait
                    // returns, the Python side passes disjoint memory, and the
                    // future is driven to completion or dropped inside the wait.
                    dst: unsafe { slice_mut(*raw) },
                })
                .collect();
            cp.load_boxes_into(&id, targets).await.map(|_| ())
        });
        drop(held);
        done.and_then(IntoPyResult::py)
    }

    /// The metadata tree and tensor table of a checkpoint, without reading any
    /// tensor: `(meta, {name: TensorInfo})`.
    #[pyo3(signature = (step, attempt))]
    fn contents<'py>(
        &self,
        py: Python<'py>,
        step: u64,
        attempt: String,
    ) -> PyResult<(Py<PyAny>, Bound<'py, PyDict>)> {
        let cp = self.core()?.clone();
        let id = CheckpointId { step, attempt };
        // The root alone: its index lists every tensor without a fragment read.
        let m = runtime::wait(py, move || async move { cp.root(&id).await })
            .and_then(IntoPyResult::py)?;
        let mut table: std::collections::BTreeMap<String, TensorInfo> = Default::default();
        for (name, dtype, global, pieces) in m.table() {
            let nbytes = ckpt_core::numel(&global)
                .and_then(|n| dtype.byte_len(n))
                .py()?;
            table.insert(
                name,
                TensorInfo {
                    dtype: dtype.name().to_owned(),
                    global_shape: global,
                    pieces,
                    nbytes,
                },
            );
        }
        let d = PyDict::new(py);
        for (name, info) in table {
            d.set_item(name, info)?;
        }
        Ok((from_value(py, &m.meta)?, d))
    }

    /// What this process sent to and read from storage so far, as a dict:
    /// `read_bytes`, `written_bytes`, `gets`, `puts` (single puts and parts),
    /// `deletes`, `lists`. Subtract two readings to measure one operation.
    fn io_counts<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let c = self.counting.counts();
        let d = PyDict::new(py);
        d.set_item("read_bytes", c.get_bytes)?;
        d.set_item("written_bytes", c.written_bytes())?;
        d.set_item("gets", c.gets)?;
        d.set_item("puts", c.puts + c.parts)?;
        d.set_item("deletes", c.deletes)?;
        d.set_item("lists", c.lists)?;
        Ok(d)
    }

    /// Record that checkpoint `(step, attempt)` was found damaged by a load, so
    /// its step may be saved again.
    fn note_damaged(&self, step: u64, attempt: String) -> PyResult<()> {
        self.core()?.note_damaged(&CheckpointId { step, attempt });
        Ok(())
    }

    /// The metadata tree of a checkpoint, without reading any tensor.
    #[pyo3(signature = (step, attempt=None))]
    fn meta(&self, py: Python<'_>, step: u64, attempt: Option<String>) -> PyResult<Py<PyAny>> {
        let id = self.resolve(py, step, attempt)?;
        let cp = self.core()?.clone();
        let m = runtime::wait(py, move || async move { cp.root(&id).await })
            .and_then(IntoPyResult::py)?;
        from_value(py, &m.meta)
    }

    /// Claim the next writer epoch of the root (rank 0, once); the epoch, or
    /// `None` on other ranks.
    fn claim(&self, py: Python<'_>) -> PyResult<Option<u64>> {
        let cp = self.core()?.clone();
        runtime::wait(py, move || async move { cp.claim().await }).and_then(IntoPyResult::py)
    }

    /// Every rank's `data`, in rank order, on the checkpointer's coordinator
    /// with its collective timeout (a rank that does not take part is named
    /// in a `StragglerError`, with `phase`).
    #[pyo3(signature = (data, phase="a collective"))]
    fn all_gather<'py>(
        &self,
        py: Python<'py>,
        data: &[u8],
        phase: &str,
    ) -> PyResult<Vec<Bound<'py, PyBytes>>> {
        let (cp, data, phase) = (self.core()?.clone(), data.to_vec(), phase.to_owned());
        let all = runtime::wait(py, move || async move { cp.all_gather(data, &phase).await })
            .and_then(IntoPyResult::py)?;
        Ok(all.iter().map(|b| PyBytes::new(py, b)).collect())
    }

    /// `root`'s `data` on every rank; as `all_gather`.
    #[pyo3(signature = (data, root, phase="a collective"))]
    fn broadcast<'py>(
        &self,
        py: Python<'py>,
        data: &[u8],
        root: usize,
        phase: &str,
    ) -> PyResult<Bound<'py, PyBytes>> {
        let (cp, data, phase) = (self.core()?.clone(), data.to_vec(), phase.to_owned());
        let out = runtime::wait(
            py,
            move || async move { cp.broadcast(data, root, &phase).await },
        )
        .and_then(IntoPyResult::py)?;
        Ok(PyBytes::new(py, &out))
    }

    /// Committed checkpoints, oldest first, as `(step, attempt)`.
    fn committed(&self, py: Python<'_>) -> PyResult<Vec<(u64, String)>> {
        let cp = self.core()?.clone();
        let ids = runtime::wait(py, move || async move { cp.committed().await })
            .and_then(IntoPyResult::py)?;
        Ok(ids.into_iter().map(|id| (id.step, id.attempt)).collect())
    }

    /// Saves cut off before their commit that left a folder under `data/`,
    /// oldest first, as `(step, attempt)` (two listings; no object read).
    fn uncommitted(&self, py: Python<'_>) -> PyResult<Vec<(u64, String)>> {
        let cp = self.core()?.clone();
        let ids = runtime::wait(py, move || async move { cp.uncommitted().await })
            .and_then(IntoPyResult::py)?;
        Ok(ids.into_iter().map(|id| (id.step, id.attempt)).collect())
    }

    /// Every checkpoint under the root, committed or incomplete, as dicts with
    /// `step`, `attempt`, `status` (`committed`, `incomplete`, `corrupt`),
    /// `reason`, `bytes`, `tensors`, `format`. `verify=True` reads all data.
    #[pyo3(signature = (verify=false))]
    fn list<'py>(&self, py: Python<'py>, verify: bool) -> PyResult<Bound<'py, PyList>> {
        let cp = self.core()?.clone();
        let rows = runtime::wait(py, move || async move { cp.list(verify).await })
            .and_then(IntoPyResult::py)?;
        let out = PyList::empty(py);
        for r in rows {
            let d = PyDict::new(py);
            d.set_item("step", r.id.step)?;
            d.set_item("attempt", &r.id.attempt)?;
            let (status, reason) = match &r.status {
                Status::Committed => ("committed", None),
                Status::Incomplete => ("incomplete", None),
                Status::Corrupt(why) => ("corrupt", Some(why.clone())),
                Status::Fenced => ("fenced", None),
                Status::Unsupported(why) => ("unsupported", Some(why.clone())),
                _ => ("unknown", None),
            };
            d.set_item("status", status)?;
            d.set_item("epoch", r.epoch)?;
            d.set_item("reason", reason)?;
            d.set_item("bytes", r.bytes)?;
            d.set_item("tensors", r.tensors)?;
            d.set_item("format", r.format)?;
            out.append(d)?;
        }
        Ok(out)
    }

    /// Apply retention and delete unreferenced data now, once saves of this
    /// process in flight are written. In a job of several ranks, call it on
    /// rank 0 only.
    fn gc(&self, py: Python<'_>) -> PyResult<GcReport> {
        let cp = self.core()?.clone();
        let r =
            runtime::wait(py, move || async move { cp.gc().await }).and_then(IntoPyResult::py)?;
        Ok(GcReport::from(&r))
    }

    /// Discard the committed checkpoints of steps after `step` (a rollback),
    /// once saves of this process in flight are written. In a job of several
    /// ranks, rank 0 discards; other ranks return an empty report.
    fn discard_after(&self, py: Python<'_>, step: u64) -> PyResult<GcReport> {
        let cp = self.core()?.clone();
        let r = runtime::wait(py, move || async move { cp.discard_after(step).await })
            .and_then(IntoPyResult::py)?;
        Ok(GcReport::from(&r))
    }

    fn __repr__(&self) -> String {
        format!(
            "Checkpointer({:?}, lazy={}, rank={}, world_size={})",
            self.inner.url(),
            self.lazy,
            self.inner.rank(),
            self.inner.world_size()
        )
    }
}

/// The `state` entry of a save's metadata mapping.
/// The engine's tensors for `tensors`: slab slots and shared snapshots as
/// they are, other buffers as sources to copy, one source per memory span
/// (a weight tied between two modules is staged, and hashed, once).
fn sources(py: Python<'_>, tensors: &[Bound<'_, TensorSpec>]) -> PyResult<Vec<SourceTensor>> {
    let mut out = Vec::with_capacity(tensors.len());
    let mut sources: HashMap<(usize, usize), Arc<dyn CopySource>> = HashMap::new();
    for t in tensors.iter() {
        let t = t.get();
        let (name, dtype, shape) = (t.name.clone(), t.dtype, t.shape.clone());
        let shard = t.shard.as_ref().map(|s| s.get().spec());
        let obj = t.data.bind(py);
        if let Ok(slot) = obj.cast::<SlabSlot>() {
            out.push(SourceTensor {
                name,
                dtype,
                shape,
                shard,
                data: TensorData::Shared(slot.get().bytes(py)?),
            });
            continue;
        }
        if let Ok(snap) = obj.cast::<SnapshotBytes>() {
            out.push(SourceTensor {
                name,
                dtype,
                shape,
                shard,
                data: TensorData::Shared(snap.get().bytes.clone()),
            });
            continue;
        }
        // (A CPU tensor of a repeated save: its storage, no buffer export.)
        let (span, src): ((usize, usize), Arc<dyn CopySource>) =
            if let Ok(host) = obj.cast::<HostSpan>() {
                let src = host.get().source(py);
                (src.span(), Arc::new(src))
            } else {
                let src = PySource::new(obj, &name)?;
                (src.span(), Arc::new(src))
            };
        let shared = sources.entry(span).or_insert(src).clone();
        // `copy_now`: copied in the stall into staging, in lazy mode too.
        let data = if t.copy_now {
            TensorData::CopyNow(shared)
        } else {
            TensorData::Copy(shared)
        };
        out.push(SourceTensor {
            name,
            dtype,
            shape,
            shard,
            data,
        });
    }
    Ok(out)
}

fn state_of(meta: &Value) -> Option<&Value> {
    match meta {
        Value::Map(entries) => state_of_entries(entries),
        _ => None,
    }
}

fn state_of_entries(entries: &[(Key, Value)]) -> Option<&Value> {
    entries
        .iter()
        .find(|(k, _)| matches!(k, Key::Str(s) if s == "state"))
        .map(|(_, v)| v)
}

fn tensors_to_py(py: Python<'_>, tensors: Vec<Tensor>) -> PyResult<Bound<'_, PyDict>> {
    let d = PyDict::new(py);
    for t in tensors {
        let buf = Py::new(py, TensorBuffer::new(t.data))?;
        d.set_item(t.name, (t.dtype.name(), t.shape, buf))?;
    }
    Ok(d)
}

fn loaded_to_py(py: Python<'_>, l: Loaded) -> PyResult<Bound<'_, PyTuple>> {
    let meta = from_value(py, &l.state.meta)?;
    let tensors = tensors_to_py(py, l.state.tensors)?;
    let skipped = PyList::empty(py);
    for (id, err) in l.skipped {
        skipped.append((id.step, id.attempt, to_py(err).into_value(py)))?;
    }
    (l.id.step, l.id.attempt, tensors, meta, skipped).into_pyobject(py)
}
