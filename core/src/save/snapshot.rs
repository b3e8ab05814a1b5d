//! Capture: what `save` is given, and the snapshot that copies it into staging.
//!
//! A tensor is captured either as [`TensorData::Shared`] (immutable [`Bytes`]:
//! nothing to copy) or as [`TensorData::Copy`] (memory the training loop will
//! mutate later, e.g. a model parameter): those are copied into staging buffers,
//! which is the only part of a save the training loop has to wait for. A lazy
//! snapshot copies them in the background, except [`TensorData::CopyNow`]
//! ones (memory that changes before anything the loop waits on), which it
//! copies before `save` returns ([`copy_now_first`]).

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;

use crate::error::{Error, Result};
use crate::model::dtype::DType;
use crate::model::state::State;
use crate::model::tensor::{ShardSpec, Tensor};
use crate::model::value::Value;
use crate::staging::StagingBuf;
use crate::sync::RwLockExt;

/// Memory that a snapshot copies from.
///
/// # Lazy snapshots
/// In lazy mode `copy_into` runs on a background thread after `save` returned.
/// The implementor must keep the memory alive and the caller must not mutate it
/// until the save handle's `wait_snapshot()` returned.
pub trait CopySource: Send + Sync + 'static {
    /// Number of bytes.
    fn len(&self) -> usize;

    /// True when there is nothing to copy.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Copy the current contents into `dst` (`dst.len() == self.len()`).
    fn copy_into(&self, dst: &mut [u8]) -> Result<()>;
}

/// What a snapshot waits for before it reads a capture's memory: copies that
/// something outside the engine still has in flight into it, such as a GPU's
/// device-to-host copies into a [`Slab`](super::slab::Slab) queued on a
/// stream. A lazy snapshot waits on its background thread, so `save` returns
/// before the copies have landed; an eager one waits inside `save`.
pub trait Ready: Send + Sync + std::fmt::Debug + 'static {
    /// Block until every byte the capture refers to may be read.
    fn wait(&self) -> Result<()>;
}

/// Where a captured tensor's bytes come from.
#[derive(Clone)]
pub enum TensorData {
    /// Immutable bytes, captured without a copy.
    Shared(Bytes),
    /// Mutable memory, copied into staging by the snapshot. One source (the
    /// same `Arc`) given for several tensors, such as a weight tied between an
    /// embedding and an output layer, is copied once and the tensors share
    /// the copy.
    Copy(Arc<dyn CopySource>),
    /// Mutable memory copied into staging before `save` returns, in lazy
    /// mode too: memory that changes before anything the loop waits on (a
    /// tensor no optimizer step guards, batch-norm statistics). In eager
    /// mode the same as [`Copy`](Self::Copy).
    CopyNow(Arc<dyn CopySource>),
}

impl std::fmt::Debug for TensorData {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            TensorData::Shared(b) => write!(f, "Shared({} bytes)", b.len()),
            TensorData::Copy(c) => write!(f, "Copy({} bytes)", c.len()),
            TensorData::CopyNow(c) => write!(f, "CopyNow({} bytes)", c.len()),
        }
    }
}

impl TensorData {
    /// Number of bytes.
    pub fn len(&self) -> usize {
        match self {
            TensorData::Shared(b) => b.len(),
            TensorData::Copy(c) | TensorData::CopyNow(c) => c.len(),
        }
    }

    /// True when empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// One tensor handed to `save`.
#[derive(Debug, Clone)]
pub struct SourceTensor {
    /// Unique name.
    pub name: String,
    /// Element type.
    pub dtype: DType,
    /// Shape.
    pub shape: Vec<u64>,
    /// Placement in a global tensor, if sharded.
    pub shard: Option<ShardSpec>,
    /// The bytes.
    pub data: TensorData,
}

/// Everything handed to one `save`.
#[derive(Debug, Clone, Default)]
pub struct Capture {
    /// The tensors.
    pub tensors: Vec<SourceTensor>,
    /// Non-tensor state.
    pub meta: Value,
    /// Waited for before any tensor's bytes are read (see [`Ready`]).
    pub ready: Option<Arc<dyn Ready>>,
}

impl Capture {
    /// Add a tensor copied from mutable memory at snapshot time.
    pub fn with_copy(
        mut self,
        name: impl Into<String>,
        dtype: DType,
        shape: Vec<u64>,
        source: Arc<dyn CopySource>,
    ) -> Self {
        self.tensors.push(SourceTensor {
            name: name.into(),
            dtype,
            shape,
            shard: None,
            data: TensorData::Copy(source),
        });
        self
    }

    /// Bytes that the snapshot must copy.
    pub fn copy_bytes(&self) -> u64 {
        self.copy_lens().iter().map(|&l| l as u64).sum()
    }

    /// The lengths of the distinct sources to copy (a source given for
    /// several tensors counts once), in the order of their first tensor: the
    /// staging buffers the snapshot needs.
    pub fn copy_lens(&self) -> Vec<usize> {
        let mut seen = std::collections::HashSet::new();
        self.tensors
            .iter()
            .filter_map(|t| match &t.data {
                TensorData::Copy(src) | TensorData::CopyNow(src)
                    if seen.insert(source_key(src)) =>
                {
                    Some(src.len())
                }
                _ => None,
            })
            .collect()
    }

    /// Total tensor bytes.
    pub fn nbytes(&self) -> u64 {
        self.tensors.iter().map(|t| t.data.len() as u64).sum()
    }
}

impl From<State> for Capture {
    fn from(state: State) -> Self {
        Capture {
            tensors: state
                .tensors
                .into_iter()
                .map(|t| SourceTensor {
                    name: t.name,
                    dtype: t.dtype,
                    shape: t.shape,
                    shard: t.shard,
                    data: TensorData::Shared(t.data),
                })
                .collect(),
            meta: state.meta,
            ready: None,
        }
    }
}

impl From<&State> for Capture {
    fn from(state: &State) -> Self {
        Capture::from(state.clone())
    }
}

/// A [`CopySource`] over owned memory behind a lock, handy for tests and for
/// training loops that keep parameters in `Vec<u8>`.
#[derive(Debug, Default)]
pub struct SharedVec(pub std::sync::RwLock<Vec<u8>>);

impl SharedVec {
    /// Wrap a vector.
    pub fn new(v: Vec<u8>) -> Arc<Self> {
        Arc::new(SharedVec(std::sync::RwLock::new(v)))
    }
}

impl CopySource for SharedVec {
    fn len(&self) -> usize {
        self.0.read_unpoisoned().len()
    }

    fn copy_into(&self, dst: &mut [u8]) -> Result<()> {
        let src = self.0.read_unpoisoned();
        if src.len() != dst.len() {
            return Err(Error::InvalidInput(
                "source changed size during the snapshot".into(),
            ));
        }
        dst.copy_from_slice(&src);
        Ok(())
    }
}

/// Wait for `ready` (memory still being filled from outside), then [`copy_all`].
pub fn wait_and_copy(
    ready: Option<&dyn Ready>,
    tensors: Vec<SourceTensor>,
    bufs: Vec<StagingBuf>,
    threads: usize,
) -> Result<Vec<Tensor>> {
    if let Some(ready) = ready {
        ready.wait()?;
    }
    copy_all(tensors, bufs, threads)
}

/// Lazy mode, in the stall: copy the sources of [`TensorData::CopyNow`]
/// tensors into their staging buffers (as [`copy_all`] does) and hand them
/// back as [`TensorData::Shared`], with the buffers left for the other
/// `Copy` tensors, in their order (what `copy_all` pairs them with later). A
/// source given as `CopyNow` for any tensor is copied now for all of them.
pub fn copy_now_first(
    mut tensors: Vec<SourceTensor>,
    bufs: Vec<StagingBuf>,
    threads: usize,
) -> Result<(Vec<SourceTensor>, Vec<StagingBuf>)> {
    let now_keys: std::collections::HashSet<usize> = tensors
        .iter()
        .filter_map(|t| match &t.data {
            TensorData::CopyNow(src) => Some(source_key(src)),
            _ => None,
        })
        .collect();
    if now_keys.is_empty() {
        return Ok((tensors, bufs));
    }
    // Buffers go to distinct sources in order of their first tensor (`copy_lens`).
    let mut bufs = bufs.into_iter();
    let mut seen = std::collections::HashSet::new();
    let (mut now, mut now_bufs, mut later_bufs, mut at) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for (i, t) in tensors.iter().enumerate() {
        let (TensorData::Copy(src) | TensorData::CopyNow(src)) = &t.data else {
            continue;
        };
        let key = source_key(src);
        if seen.insert(key) {
            let buf = bufs
                .next()
                .ok_or_else(|| Error::Internal("staging buffer count".into()))?;
            if now_keys.contains(&key) {
                now_bufs.push(buf);
            } else {
                later_bufs.push(buf);
            }
        }
        if now_keys.contains(&key) {
            now.push(SourceTensor {
                data: TensorData::Copy(src.clone()),
                ..t.clone()
            });
            at.push(i);
        }
    }
    for (i, copied) in at.into_iter().zip(copy_all(now, now_bufs, threads)?) {
        tensors[i].data = TensorData::Shared(copied.data);
    }
    Ok((tensors, later_bufs))
}

/// Copy every `Copy` tensor into its staging buffer, spread over `threads` threads
/// (balanced by bytes), and return the tensors with frozen bytes in input order.
///
/// In debug builds each source is read a second time after its copy and compared,
/// so a mutation during a (lazy) snapshot is reported instead of saved silently.
pub fn copy_all(
    tensors: Vec<SourceTensor>,
    mut bufs: Vec<StagingBuf>,
    threads: usize,
) -> Result<Vec<Tensor>> {
    // Pair each Copy tensor with its buffer.
    let mut jobs: Vec<CopyJob> = Vec::new();
    let mut out: Vec<Option<Tensor>> = Vec::with_capacity(tensors.len());
    bufs.reverse();
    // Tensors whose source another tensor already copies: (tensor, that tensor).
    let mut first_of = std::collections::HashMap::new();
    let mut aliases: Vec<(usize, usize)> = Vec::new();
    for (i, t) in tensors.into_iter().enumerate() {
        match t.data {
            TensorData::Shared(data) => {
                out.push(Some(make(t.name, t.dtype, t.shape, t.shard, data)?))
            }
            TensorData::Copy(src) | TensorData::CopyNow(src) => {
                match first_of.entry(source_key(&src)) {
                    std::collections::hash_map::Entry::Occupied(e) => aliases.push((i, *e.get())),
                    std::collections::hash_map::Entry::Vacant(e) => {
                        e.insert(i);
                        let buf = bufs
                            .pop()
                            .ok_or_else(|| Error::Internal("staging buffer count".into()))?;
                        jobs.push((i, src, buf));
                    }
                }
                out.push(Some(Tensor {
                    name: t.name,
                    dtype: t.dtype,
                    shape: t.shape,
                    shard: t.shard,
                    data: Bytes::new(),
                }));
            }
        }
    }
    // Balance bytes over threads: largest first, each to the least loaded thread.
    let bytes = jobs.iter().map(|(_, s, _)| s.len()).sum();
    let threads = copy_threads(bytes, jobs.len(), threads);
    jobs.sort_by_key(|(_, s, _)| std::cmp::Reverse(s.len()));
    let mut groups: Vec<(usize, Vec<CopyJob>)> = (0..threads).map(|_| (0, Vec::new())).collect();
    for job in jobs {
        let g = groups
            .iter_mut()
            .min_by_key(|(load, _)| *load)
            .expect("at least one group");
        g.0 += job.1.len();
        g.1.push(job);
    }
    // The calling thread copies the first group itself: a save's few small
    // tensors (RNG states, copied in a lazy save's stall) start no thread.
    let mut groups = groups.into_iter().map(|(_, group)| group);
    let mine = groups.next().unwrap_or_default();
    let results: Vec<Result<Vec<(usize, Bytes)>>> = std::thread::scope(|scope| {
        let handles: Vec<_> = groups
            .map(|group| scope.spawn(move || copy_group(group)))
            .collect();
        let mut results = vec![copy_group(mine)];
        results.extend(handles.into_iter().map(|h| {
            h.join()
                .unwrap_or_else(|_| Err(Error::Internal("snapshot thread panicked".into())))
        }));
        results
    });
    for r in results {
        for (i, data) in r? {
            if let Some(t) = out[i].as_mut() {
                t.data = data;
            }
        }
    }
    for (i, first) in aliases {
        let data = out[first]
            .as_ref()
            .map(|t| t.data.clone())
            .unwrap_or_default();
        if let Some(t) = out[i].as_mut() {
            t.data = data;
        }
    }
    out.into_iter()
        .map(|t| {
            let t = t.ok_or_else(|| Error::Internal("snapshot slot".into()))?;
            t.validate()?;
            Ok(t)
        })
        .collect()
}

/// The fewest bytes worth a copy thread of their own: starting and joining a
/// thread takes tens of microseconds, about what a MiB takes to copy.
const MIN_THREAD_BYTES: usize = 4 << 20;

/// Threads that copy `jobs` sources of `bytes` in all, at most `threads`: one
/// per [`MIN_THREAD_BYTES`], and never more than there are sources.
fn copy_threads(bytes: usize, jobs: usize, threads: usize) -> usize {
    threads
        .min(bytes.div_ceil(MIN_THREAD_BYTES))
        .min(jobs)
        .max(1)
}

/// One copy: the tensor's index, its source and its staging buffer.
type CopyJob = (usize, Arc<dyn CopySource>, StagingBuf);

/// Identity of a copy source: the `Arc`'s allocation.
fn source_key(src: &Arc<dyn CopySource>) -> usize {
    Arc::as_ptr(src).cast::<()>() as usize
}

fn copy_group(group: Vec<CopyJob>) -> Result<Vec<(usize, Bytes)>> {
    let mut done = Vec::with_capacity(group.len());
    for (i, src, mut buf) in group {
        src.copy_into(buf.as_mut_slice())?;
        #[cfg(debug_assertions)]
        {
            let mut again = vec![0u8; buf.as_ref().len()];
            src.copy_into(&mut again)?;
            if again != buf.as_ref() {
                return Err(Error::InvalidInput(format!(
                    "tensor #{i} was modified while its snapshot was being taken; \
                     call wait_snapshot() before mutating state (e.g. before optimizer.step())"
                )));
            }
        }
        done.push((i, buf.freeze()));
    }
    Ok(done)
}

fn make(
    name: String,
    dtype: DType,
    shape: Vec<u64>,
    shard: Option<ShardSpec>,
    data: Bytes,
) -> Result<Tensor> {
    let t = Tensor {
        name,
        dtype,
        shape,
        data,
        shard,
    };
    t.validate()?;
    Ok(t)
}

/// How far the snapshot of a save has got: `save` sends it, the persist task
/// and [`SaveHandle`](super::SaveHandle) watch it.
#[derive(Debug, Clone)]
pub(crate) enum SnapState {
    Pending,
    Done(Duration),
    Failed(Arc<Error>),
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::staging::{BusyPolicy, StagingPool};

    #[test]
    fn small_copies_start_no_thread_and_large_ones_share_the_cores() {
        // A lazy save's RNG states (a few KiB) are copied by the caller alone.
        assert_eq!(copy_threads(20 << 10, 4, 8), 1);
        assert_eq!(copy_threads(0, 0, 8), 1);
        // A thread per MIN_THREAD_BYTES, at most `threads`, at most a thread a source.
        assert_eq!(copy_threads(MIN_THREAD_BYTES + 1, 10, 8), 2);
        assert_eq!(copy_threads(256 << 20, 64, 8), 8);
        assert_eq!(copy_threads(256 << 20, 3, 8), 3);
        assert_eq!(copy_threads(256 << 20, 64, 1), 1);
    }

    async fn copied(sizes: &[usize], threads: usize) {
        let srcs: Vec<Arc<SharedVec>> = sizes
            .iter()
            .enumerate()
            .map(|(i, &n)| SharedVec::new((0..n).map(|b| (b * 7 + i) as u8).collect()))
            .collect();
        let mut tensors: Vec<SourceTensor> = srcs
            .iter()
            .enumerate()
            .map(|(i, s)| SourceTensor {
                name: format!("t{i}"),
                dtype: DType::U8,
                shape: vec![sizes[i] as u64],
                shard: None,
                data: TensorData::Copy(s.clone()),
            })
            .collect();
        // The same source twice (a tied weight): copied once, shared.
        tensors.push(SourceTensor {
            name: "tied".into(),
            dtype: DType::U8,
            shape: vec![sizes[0] as u64],
            shard: None,
            data: TensorData::Copy(srcs[0].clone()),
        });
        let pool = StagingPool::new(1 << 30);
        let bufs = pool.acquire(sizes, BusyPolicy::Wait, 1).await.unwrap();
        let out = copy_all(tensors, bufs, threads).unwrap();
        for (i, t) in out.iter().take(sizes.len()).enumerate() {
            assert_eq!(
                t.data.as_ref(),
                srcs[i].0.read_unpoisoned().as_slice(),
                "tensor {i}"
            );
        }
        assert_eq!(out[sizes.len()].data, out[0].data);
    }

    #[tokio::test]
    async fn copy_all_copies_every_source_once_on_one_thread_or_several() {
        // Small ones on the calling thread alone; large ones over four threads.
        copied(&[3, 4096, 100, 1], 8).await;
        copied(&[9 << 20, 5 << 20, 1, 4 << 20, 7], 4).await;
    }
}
