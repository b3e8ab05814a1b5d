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
use crate::save::copy::{self, CopyJob};
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

    /// Whether [`copy_range_into`](Self::copy_range_into) copies a part:
    /// the snapshot then cuts a large source over several threads.
    fn splits(&self) -> bool {
        false
    }

    /// Copy the `dst.len()` bytes that start `offset` bytes in: the whole
    /// source too (offset 0, its length). A part is asked only where
    /// [`splits`](Self::splits) is true; the default copies only the whole
    /// source, through [`copy_into`](Self::copy_into).
    fn copy_range_into(&self, offset: usize, dst: &mut [u8]) -> Result<()> {
        if offset == 0 && dst.len() == self.len() {
            return self.copy_into(dst);
        }
        Err(Error::Internal(
            "a part asked of a source that copies only whole".into(),
        ))
    }
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

    fn splits(&self) -> bool {
        true
    }

    fn copy_range_into(&self, offset: usize, dst: &mut [u8]) -> Result<()> {
        let src = self.0.read_unpoisoned();
        let part = offset
            .checked_add(dst.len())
            .and_then(|end| src.get(offset..end))
            .ok_or_else(|| Error::InvalidInput("source changed size during the snapshot".into()))?;
        dst.copy_from_slice(part);
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
/// (balanced by bytes, see [`copy`]), and return the tensors with frozen bytes in input order.
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
    for (i, data) in copy::run(jobs, threads)? {
        if let Some(t) = out[i].as_mut() {
            t.data = data;
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

/// Identity of a copy source: the `Arc`'s allocation.
fn source_key(src: &Arc<dyn CopySource>) -> usize {
    Arc::as_ptr(src).cast::<()>() as usize
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
