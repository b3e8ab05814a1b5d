//! Loading: one checkpoint, the newest good one, or single tensors; and listing and verifying.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::{StreamExt, TryStreamExt};

use crate::checkpointer::Checkpointer;
use crate::error::{Error, Result};
use crate::format::ReadContext;
use crate::layout::catalog;
use crate::layout::epoch::{self, EpochView, Verdict};
use crate::layout::manifest::{Manifest, TensorRecord};
use crate::model::state::State;
use crate::model::tensor::Tensor;
use crate::model::CheckpointId;

/// A loaded checkpoint.
#[derive(Debug)]
pub struct Loaded {
    /// Which checkpoint.
    pub id: CheckpointId,
    /// Its manifest.
    pub manifest: Manifest,
    /// The state, every tensor verified.
    pub state: State,
    /// Newer checkpoints that `load_latest` skipped, and why.
    pub skipped: Vec<(CheckpointId, Error)>,
    /// Wall time of the load.
    pub elapsed: Duration,
}

/// Status of a stored checkpoint.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Status {
    /// The manifest exists and parses. (Use `verify` to check the data.)
    Committed,
    /// Data without a manifest: a save that crashed or is in progress.
    Incomplete,
    /// The manifest or data is damaged.
    Corrupt(String),
    /// Committed by a writer whose epoch was over (a zombie incarnation of
    /// the job): stored, but never loaded, and retired by the next GC.
    Fenced,
    /// Stored in a way this build cannot read (a newer ckpt's manifest, a
    /// format built out): not damage, and never passed over by a load.
    Unsupported(String),
}

impl Status {
    /// The status of a checkpoint that could not be read or verified.
    fn of(e: &Error) -> Status {
        match e {
            Error::Unsupported(_) => Status::Unsupported(e.to_string()),
            _ => Status::Corrupt(e.to_string()),
        }
    }
}

/// One row of a listing.
#[derive(Debug, Clone)]
pub struct CheckpointInfo {
    /// Which checkpoint.
    pub id: CheckpointId,
    /// Its status.
    pub status: Status,
    /// Raw tensor bytes (committed) or bytes of data objects (incomplete).
    pub bytes: u64,
    /// Number of tensors (0 when unknown).
    pub tensors: usize,
    /// Format name, when known.
    pub format: Option<String>,
    /// The writer epoch that committed it, when known (0: before epochs).
    pub epoch: Option<u64>,
}

impl Checkpointer {
    pub(crate) fn read_ctx(&self) -> ReadContext {
        ReadContext {
            store: self.store().clone(),
            chunks: self.chunks().clone(),
            cache: Default::default(),
            concurrency: self.options().load_concurrency.max(1),
            tensors_in_flight: ReadContext::TENSORS_IN_FLIGHT,
            fetches: Arc::new(tokio::sync::Semaphore::new(
                self.options().load_concurrency.max(1),
            )),
            coalesce_bytes: self.capabilities().coalesce_bytes,
        }
    }

    /// Ids of the committed checkpoints that count, oldest first: those a
    /// fenced writer committed after a newer epoch claimed the root (zombies,
    /// see [`crate::layout::epoch`]) are left out.
    ///
    /// The listing also serves this checkpointer's first save, which would
    /// list the same (a restart's `load_latest` lists, then saves): the save's
    /// step is checked against it, zombies included, without a round trip in
    /// its stall.
    pub async fn committed(&self) -> Result<Vec<CheckpointId>> {
        let store = self.store().as_ref();
        let view = EpochView::read(store).await?;
        let seen = self.fencing().manifest_epochs();
        let (valid, zombies) = epoch::partition_committed(store, &view, seen).await?;
        self.known().seed(valid.iter().chain(&zombies).cloned());
        Ok(valid)
    }

    /// Saves that left a folder under `data/` and no manifest, oldest first
    /// (see [`catalog::uncommitted`]): what a restart passes over when such a
    /// save is newer than the checkpoint it resumes from. Two listings, of
    /// `data/` by folder and of `manifests/`; no object is read.
    pub async fn uncommitted(&self) -> Result<Vec<CheckpointId>> {
        catalog::uncommitted(self.store().as_ref()).await
    }

    /// The manifest of a checkpoint, with every record (a root's fragments
    /// read: O(ranks) objects for a checkpoint of many ranks).
    pub async fn manifest(&self, id: &CheckpointId) -> Result<Manifest> {
        catalog::read_full(self.store().as_ref(), id).await
    }

    /// The manifest alone: for a checkpoint of several ranks its root, whose
    /// records are in fragments ([`Manifest::table`] lists its tensors).
    pub async fn root(&self, id: &CheckpointId) -> Result<Manifest> {
        catalog::read_manifest(self.store().as_ref(), id).await
    }

    /// Load one checkpoint, verifying every tensor.
    pub async fn load(&self, id: &CheckpointId) -> Result<Loaded> {
        let start = Instant::now();
        let manifest = self.manifest(id).await?;
        self.load_with(id, manifest, start).await
    }

    async fn load_with(
        &self,
        id: &CheckpointId,
        manifest: Manifest,
        start: Instant,
    ) -> Result<Loaded> {
        let tensors = self.read_whole(&manifest).await?;
        Ok(Loaded {
            id: id.clone(),
            state: State {
                tensors,
                meta: manifest.meta.clone(),
            },
            manifest,
            skipped: Vec::new(),
            elapsed: start.elapsed(),
        })
    }

    /// Load the committed checkpoint of a step.
    pub async fn load_step(&self, step: u64) -> Result<Loaded> {
        let store = self.store().as_ref();
        let view = EpochView::read(store).await?;
        for id in catalog::committed_at(store, step).await? {
            let manifest = self.root(&id).await?;
            if view.judge(&id, manifest.epoch) == Verdict::Valid {
                return self.load(&id).await;
            }
        }
        Err(Error::NotFound {
            what: format!("checkpoint of step {step}"),
        })
    }

    /// Load the newest checkpoint that is committed and intact.
    ///
    /// Newer checkpoints that are damaged (corrupt or missing data, unreadable
    /// manifest) are skipped and listed in [`Loaded::skipped`]. Returns `None` when
    /// no checkpoint can be loaded. Storage failures are returned as errors, not
    /// skipped: a flaky store must not make an old checkpoint look like the newest.
    ///
    /// A writer claims its epoch first ([`Self::claim`]), so that an older
    /// incarnation still running can no longer add a checkpoint this load or
    /// a later one would pick; checkpoints such a zombie committed after a
    /// claim are passed over.
    pub async fn load_latest(&self) -> Result<Option<Loaded>> {
        self.claimed().await?;
        let store = self.store().as_ref();
        let view = EpochView::read(store).await?;
        let mut skipped = Vec::new();
        for id in catalog::committed(store).await?.into_iter().rev() {
            let start = Instant::now();
            let loaded = match self.root(&id).await {
                Ok(m) if view.judge(&id, m.epoch) == Verdict::Zombie => {
                    tracing::info!("passing over {id}: committed by a fenced writer");
                    continue;
                }
                Ok(m) => match catalog::expand(store, m, None).await {
                    Ok(m) => self.load_with(&id, m, start).await,
                    Err(e) => Err(e),
                },
                Err(e) => Err(e),
            };
            match loaded {
                Ok(mut loaded) => {
                    loaded.skipped = skipped;
                    return Ok(Some(loaded));
                }
                Err(e) if e.is_damage() => {
                    self.known().note_damaged(&id);
                    tracing::warn!("skipping damaged checkpoint {id}: {e}");
                    skipped.push((id, e));
                }
                Err(e) => return Err(e),
            }
        }
        if let Some((_, first)) = skipped.first() {
            tracing::warn!("no intact checkpoint; newest failure: {first}");
        }
        Ok(None)
    }

    /// Record that a load found checkpoint `id` damaged (as [`Self::load_latest`]
    /// does when it skips one), so that its step may be saved again. For callers
    /// that walk the checkpoints themselves (partial, per-rank loads).
    pub fn note_damaged(&self, id: &CheckpointId) {
        self.known().note_damaged(id);
    }

    /// Load only the named tensors of a checkpoint (reads only their objects).
    pub async fn load_tensors(&self, id: &CheckpointId, names: &[&str]) -> Result<Vec<Tensor>> {
        let root = self.root(id).await?;
        let manifest = self.select(root, names.iter().map(|n| (*n, None))).await?;
        let by_name: HashMap<&str, &TensorRecord> = manifest
            .tensors
            .iter()
            .map(|t| (t.name.as_str(), t))
            .collect();
        let records = names
            .iter()
            .map(|n| {
                by_name.get(n).copied().ok_or_else(|| Error::NotFound {
                    what: format!("tensor `{n}` in {id}"),
                })
            })
            .collect::<Result<Vec<_>>>()?;
        self.read_records(&manifest, records).await
    }

    /// Load tensors straight into caller-provided buffers (e.g. the model's own
    /// parameters), with no intermediate copy where the format allows.
    ///
    /// Each target names a tensor and gives a buffer of exactly its byte length;
    /// tensors not named are not read. Returns the manifest (for the metadata).
    ///
    /// Bytes are verified where they land, so on an error (a corrupt chunk, a
    /// failing store) some buffers may hold bytes of this checkpoint that were
    /// not verified, or were only partly read: the error says which tensor,
    /// and the caller should restore again (from another checkpoint) rather
    /// than train on those buffers.
    pub async fn load_into(
        &self,
        id: &CheckpointId,
        targets: Vec<(&str, &mut [u8])>,
    ) -> Result<Manifest> {
        let root = self.root(id).await?;
        let manifest = self
            .select(root, targets.iter().map(|(n, _)| (*n, None)))
            .await?;
        let format = self.reader(&manifest.format)?;
        let by_name: HashMap<&str, &TensorRecord> = manifest
            .tensors
            .iter()
            .map(|t| (t.name.as_str(), t))
            .collect();
        let mut jobs = Vec::with_capacity(targets.len());
        for (name, dst) in targets {
            let record = *by_name.get(name).ok_or_else(|| Error::NotFound {
                what: format!("tensor `{name}` in {id}"),
            })?;
            let want = record.nbytes()?;
            if want != dst.len() as u64 {
                return Err(Error::InvalidInput(format!(
                    "tensor `{name}` needs a buffer of {want} bytes, got {}",
                    dst.len()
                )));
            }
            jobs.push((record, dst));
        }
        format.read_many_into(&self.read_ctx(), jobs).await?;
        Ok(manifest)
    }

    /// Read and verify every tensor of a checkpoint without keeping the data.
    pub async fn verify(&self, id: &CheckpointId) -> Result<Manifest> {
        let manifest = self.manifest(id).await?;
        let format = self.reader(&manifest.format)?;
        let ctx = self.read_ctx();
        futures::stream::iter(manifest.tensors.iter())
            .map(|r| {
                let (format, ctx) = (format.clone(), ctx.clone());
                async move { format.read(&ctx, r).await.map(|_| ()) }
            })
            .buffer_unordered(self.options().load_concurrency.max(1))
            .try_collect::<Vec<()>>()
            .await?;
        Ok(manifest)
    }

    /// Every checkpoint under the root, committed and incomplete, with status.
    ///
    /// A committed checkpoint's status comes from its manifest alone; pass
    /// `verify = true` to read and check all data too.
    pub async fn list(&self, verify: bool) -> Result<Vec<CheckpointInfo>> {
        let mut out = Vec::new();
        let view = EpochView::read(self.store().as_ref()).await?;
        for id in catalog::committed(self.store().as_ref()).await? {
            let (status, m) = match self.root(&id).await {
                Ok(m) if view.judge(&id, m.epoch) == Verdict::Zombie => (Status::Fenced, Some(m)),
                Ok(m) => (Status::Committed, Some(m)),
                Err(e) => (Status::of(&e), None),
            };
            let status = match (&status, verify) {
                (Status::Committed, true) => match self.verify(&id).await {
                    Ok(_) => Status::Committed,
                    Err(e) => Status::of(&e),
                },
                _ => status,
            };
            out.push(CheckpointInfo {
                bytes: m.as_ref().map_or(0, Manifest::raw_bytes),
                tensors: m.as_ref().map_or(0, Manifest::tensor_count),
                epoch: m.as_ref().map(|m| m.epoch),
                format: m.map(|m| m.format),
                id,
                status,
            });
        }
        for (id, bytes) in catalog::incomplete(self.store().as_ref()).await? {
            out.push(CheckpointInfo {
                id,
                status: Status::Incomplete,
                bytes,
                tensors: 0,
                format: None,
                epoch: None,
            });
        }
        out.sort_by(|a, b| a.id.cmp(&b.id));
        Ok(out)
    }

    pub(crate) async fn read_records(
        &self,
        manifest: &Manifest,
        records: Vec<&TensorRecord>,
    ) -> Result<Vec<Tensor>> {
        let format = self.reader(&manifest.format)?;
        let ctx = self.read_ctx();
        let datas = format.read_many(&ctx, records.clone()).await?;
        if datas.len() != records.len() {
            return Err(Error::Internal(format!(
                "format `{}` read {} of {} tensors",
                manifest.format,
                datas.len(),
                records.len()
            )));
        }
        records
            .into_iter()
            .zip(datas)
            .map(|(r, data)| {
                let t = Tensor {
                    name: r.name.clone(),
                    dtype: r.dtype,
                    shape: r.shape.clone(),
                    data,
                    shard: r.shard.clone(),
                };
                t.validate().map_err(|e| {
                    Error::corrupt(manifest_key(manifest), Some(&r.name), e.to_string())
                })?;
                Ok(t)
            })
            .collect()
    }
}

pub(crate) fn manifest_key(m: &Manifest) -> String {
    crate::layout::paths::manifest_key(&m.id()).to_string()
}
