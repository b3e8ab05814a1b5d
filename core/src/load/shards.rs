//! Loading sharded tensors: whole (as one process sees them) or resharded into
//! any other split.
//!
//! A checkpoint saved by N ranks holds each sharded tensor as N pieces, each with
//! its offsets in the global tensor. A job of M ranks asks for the piece each rank
//! needs ([`Checkpointer::load_shards`]); only the stored pieces that overlap it are
//! read, and their overlap is copied into place ([`crate::load::reshard::copy_overlap`]).
//! [`Checkpointer::load_boxes_into`] does the same straight into caller buffers
//! (a live model's parameters, a DTensor's local shard), for many tensors at once.

use std::collections::HashMap;

use bytes::{Bytes, BytesMut};
use futures::{StreamExt, TryStreamExt};

use crate::model::dtype::DType;

use crate::checkpointer::Checkpointer;
use crate::error::{Error, Result};
use crate::layout::manifest::{Manifest, TensorRecord};
use crate::load::read::manifest_key;
use crate::load::reshard::{copy_overlap, intersect, Region};
use crate::model::tensor::{numel, ShardSpec, Tensor};
use crate::model::CheckpointId;

impl Checkpointer {
    /// Every tensor of a checkpoint, sharded ones assembled into their global shape.
    pub(crate) async fn read_whole(&self, manifest: &Manifest) -> Result<Vec<Tensor>> {
        let plain: Vec<&TensorRecord> = manifest
            .tensors
            .iter()
            .filter(|t| t.shard.is_none())
            .collect();
        let mut out = self.read_records(manifest, plain).await?;
        let mut seen = std::collections::HashSet::new();
        for r in manifest.tensors.iter().filter(|t| t.shard.is_some()) {
            if !seen.insert(r.name.as_str()) {
                continue;
            }
            let global = r
                .shard
                .as_ref()
                .map(|s| s.global_shape.clone())
                .unwrap_or_default();
            let whole = ShardSpec {
                offsets: vec![0; global.len()],
                global_shape: global,
            };
            let mut t = self.assemble(manifest, &r.name, &whole).await?;
            t.shard = None;
            out.push(t);
        }
        Ok(out)
    }

    /// Load pieces of sharded (or whole) tensors in any split.
    ///
    /// Each request is `(name, shape, spec)`: the piece of extent `shape` at
    /// `spec.offsets` of the global tensor of shape `spec.global_shape`. Only stored
    /// pieces that overlap it are read. Returns one tensor per request, its `shard`
    /// set to `spec`; a piece the checkpoint does not fully cover is an error.
    pub async fn load_shards(
        &self,
        id: &CheckpointId,
        wanted: &[(&str, Vec<u64>, ShardSpec)],
    ) -> Result<Vec<Tensor>> {
        let root = self.root(id).await?;
        let asked = wanted
            .iter()
            .map(|(n, shape, spec)| (*n, Some((&spec.offsets[..], &shape[..]))));
        let manifest = self.select(root, asked).await?;
        let mut out = Vec::with_capacity(wanted.len());
        for (name, shape, spec) in wanted {
            let mut t = self.assemble_box(&manifest, name, shape, spec).await?;
            t.shard = Some(spec.clone());
            out.push(t);
        }
        Ok(out)
    }

    async fn assemble(&self, manifest: &Manifest, name: &str, spec: &ShardSpec) -> Result<Tensor> {
        self.assemble_box(manifest, name, &spec.global_shape, spec)
            .await
    }

    /// Fill the box `(spec.offsets, shape)` of tensor `name` from the stored pieces.
    async fn assemble_box(
        &self,
        manifest: &Manifest,
        name: &str,
        shape: &[u64],
        spec: &ShardSpec,
    ) -> Result<Tensor> {
        let records: Vec<&TensorRecord> =
            manifest.tensors.iter().filter(|t| t.name == name).collect();
        let first = records.first().ok_or_else(|| Error::NotFound {
            what: format!("tensor `{name}` in {}", manifest.id()),
        })?;
        let dtype = first.dtype;
        if dtype.bits() % 8 != 0 {
            return Err(Error::InvalidInput(format!(
                "tensor `{name}`: {dtype} cannot be resharded"
            )));
        }
        let elem = dtype.bits() / 8;
        // Where each stored record sits in the global tensor.
        let placed: Vec<(&TensorRecord, Vec<u64>, Vec<u64>)> = records
            .iter()
            .map(|r| {
                let (off, _, global) = placement(r);
                (*r, off, global)
            })
            .collect();
        if placed.iter().any(|(_, _, g)| *g != spec.global_shape) {
            return Err(Error::InvalidInput(format!(
                "tensor `{name}` has global shape {:?} in the checkpoint, not {:?}",
                placed[0].2, spec.global_shape
            )));
        }
        let want = Region {
            offsets: &spec.offsets,
            shape,
        };
        if spec.offsets.len() != shape.len()
            || spec
                .offsets
                .iter()
                .zip(shape)
                .zip(&spec.global_shape)
                .any(|((o, l), g)| o.checked_add(*l).is_none_or(|e| e > *g))
        {
            return Err(Error::InvalidInput(format!(
                "tensor `{name}`: the requested box does not fit the tensor"
            )));
        }
        let len = dtype.byte_len(numel(shape)?)?;
        let mut buf = BytesMut::zeroed(
            usize::try_from(len).map_err(|_| Error::InvalidInput("tensor too large".into()))?,
        );
        let overlapping: Vec<(&TensorRecord, &Vec<u64>)> = placed
            .iter()
            .filter(|(r, off, _)| {
                intersect(
                    &Region {
                        offsets: off,
                        shape: &r.shape,
                    },
                    &want,
                )
                .is_some()
            })
            .map(|(r, off, _)| (*r, off))
            .collect();
        let records = overlapping.iter().map(|(r, _)| *r).collect();
        let datas = self.read_records(manifest, records).await?;
        let mut copied = 0u64;
        for ((r, off), t) in overlapping.iter().zip(&datas) {
            copied += copy_overlap(
                &t.data,
                &Region {
                    offsets: off,
                    shape: &r.shape,
                },
                &mut buf,
                &want,
                elem,
            )?;
        }
        if copied != len {
            return Err(Error::corrupt(
                manifest_key(manifest),
                Some(name),
                format!("the stored pieces cover {copied} of the {len} bytes asked for"),
            ));
        }
        Ok(Tensor {
            name: name.to_owned(),
            dtype,
            shape: shape.to_vec(),
            data: Bytes::from(buf),
            shard: None,
        })
    }
}

/// One destination of [`Checkpointer::load_boxes_into`]: the box of extent
/// `shape` at `spec.offsets` of tensor `name`, whose global shape is
/// `spec.global_shape`, into `dst` (row-major, exactly the box's bytes). A whole
/// tensor is the box at offset zero with `shape == spec.global_shape`.
#[derive(Debug)]
pub struct BoxTarget<'a> {
    /// Tensor name in the checkpoint.
    pub name: &'a str,
    /// The dtype the caller expects (checked against the checkpoint when given).
    pub dtype: Option<DType>,
    /// Extent of the box.
    pub shape: Vec<u64>,
    /// Global shape and the box's offsets in it.
    pub spec: ShardSpec,
    /// Where the bytes go.
    pub dst: &'a mut [u8],
}

/// A stored record's box in its global tensor: (offsets, shape, global shape).
fn placement(r: &TensorRecord) -> (Vec<u64>, Vec<u64>, Vec<u64>) {
    match &r.shard {
        Some(s) => (s.offsets.clone(), r.shape.clone(), s.global_shape.clone()),
        None => (vec![0; r.shape.len()], r.shape.clone(), r.shape.clone()),
    }
}

impl Checkpointer {
    /// Load boxes of tensors (whole tensors, or any piece of a sharded one)
    /// straight into caller buffers, reading only the stored pieces that overlap
    /// each box, verifying every object read, with up to `load_concurrency`
    /// tensors in flight.
    ///
    /// Every target is checked against the manifest before anything is read
    /// (the tensor exists, its dtype and global shape match, the box fits, the
    /// buffer has the box's length), so a mismatch leaves every buffer as it was
    /// and names the tensor. Returns the manifest.
    pub async fn load_boxes_into(
        &self,
        id: &CheckpointId,
        targets: Vec<BoxTarget<'_>>,
    ) -> Result<Manifest> {
        let root = self.root(id).await?;
        let asked = targets
            .iter()
            .map(|t| (t.name, Some((&t.spec.offsets[..], &t.shape[..]))));
        let manifest = self.select(root, asked).await?;
        let mut by_name: HashMap<&str, Vec<&TensorRecord>> = HashMap::new();
        for r in &manifest.tensors {
            by_name.entry(r.name.as_str()).or_default().push(r);
        }
        let mut jobs = Vec::with_capacity(targets.len());
        for t in targets {
            let records = by_name.get(t.name).ok_or_else(|| Error::NotFound {
                what: format!("tensor `{}` in {id}", t.name),
            })?;
            let stored = records[0];
            let (_, _, global) = placement(stored);
            if let Some(want) = t.dtype {
                if want != stored.dtype {
                    return Err(Error::InvalidInput(format!(
                        "tensor `{}` is {} in the checkpoint, {want} here",
                        t.name, stored.dtype
                    )));
                }
            }
            if global != t.spec.global_shape {
                return Err(Error::InvalidInput(format!(
                    "tensor `{}` has shape {global:?} in the checkpoint, {:?} here",
                    t.name, t.spec.global_shape
                )));
            }
            let fits = t.spec.offsets.len() == t.shape.len()
                && t.shape.len() == global.len()
                && t.spec
                    .offsets
                    .iter()
                    .zip(&t.shape)
                    .zip(&global)
                    .all(|((o, l), g)| o.checked_add(*l).is_some_and(|e| e <= *g));
            if !fits {
                return Err(Error::InvalidInput(format!(
                    "tensor `{}`: the box at {:?} of extent {:?} does not fit its shape {global:?}",
                    t.name, t.spec.offsets, t.shape
                )));
            }
            let len = stored.dtype.byte_len(numel(&t.shape)?)?;
            if len != t.dst.len() as u64 {
                return Err(Error::InvalidInput(format!(
                    "tensor `{}` needs a buffer of {len} bytes, got {}",
                    t.name,
                    t.dst.len()
                )));
            }
            if stored.dtype.bits() % 8 != 0 && (records.len() > 1 || t.shape != global) {
                return Err(Error::InvalidInput(format!(
                    "tensor `{}`: {} cannot be resharded",
                    t.name, stored.dtype
                )));
            }
            jobs.push((t, records.clone(), len));
        }
        let format = self.reader(&manifest.format)?;
        let ctx = self.read_ctx();
        let key = manifest_key(&manifest);
        // Boxes assembled from stored pieces hold those pieces in memory: at most
        // `load_concurrency` such boxes at once. Boxes read in place hold nothing
        // but the reads the context's fetch limit already bounds, so many of them
        // are in flight (the storage always has work queued).
        let assembling = tokio::sync::Semaphore::new(self.options().load_concurrency.max(1));
        let assembling = &assembling;
        // Each box with the distinct stored boxes that overlap it (identical
        // replicas are the same data). A box that is exactly one stored piece
        // is read in place, with the rest of its kind in one batch.
        let mut in_place = Vec::new();
        let mut assemble = Vec::new();
        for (t, records, len) in jobs {
            let want = Region {
                offsets: &t.spec.offsets,
                shape: &t.shape,
            };
            let mut seen = std::collections::HashSet::new();
            let overlapping: Vec<(&TensorRecord, Vec<u64>)> = records
                .iter()
                .map(|r| (*r, placement(r)))
                .filter(|(_, (off, shape, _))| {
                    intersect(
                        &Region {
                            offsets: off,
                            shape,
                        },
                        &want,
                    )
                    .is_some()
                        && seen.insert((off.clone(), shape.clone()))
                })
                .map(|(r, (off, _, _))| (r, off))
                .collect();
            match overlapping.as_slice() {
                [(r, off)] if *off == t.spec.offsets && r.shape == t.shape => {
                    in_place.push((*r, t.dst));
                }
                _ => assemble.push((t, records, len, overlapping)),
            }
        }
        let assembled = assemble.into_iter().map(|(t, records, len, overlapping)| {
            let (format, ctx, key) = (format.clone(), ctx.clone(), key.clone());
            async move {
                let want = Region {
                    offsets: &t.spec.offsets,
                    shape: &t.shape,
                };
                let _turn = assembling
                    .acquire()
                    .await
                    .map_err(|_| Error::Internal("the load's assembly limit was closed".into()))?;
                let elem = (records[0].dtype.bits() / 8).max(1);
                let mut copied = 0u64;
                for (r, off) in &overlapping {
                    let data = format
                        .read(&ctx, r)
                        .await
                        .map_err(|e| e.with_tensor(t.name))?;
                    let src = Region {
                        offsets: off,
                        shape: &r.shape,
                    };
                    copied += copy_overlap(&data, &src, t.dst, &want, elem)
                        .map_err(|e| Error::corrupt(key.clone(), Some(t.name), e.to_string()))?;
                }
                if copied != len {
                    return Err(Error::corrupt(
                        key,
                        Some(t.name),
                        format!("the stored pieces cover {copied} of the {len} bytes asked for"),
                    ));
                }
                Ok(())
            }
        });
        let assembled = futures::stream::iter(assembled)
            .buffer_unordered(ctx.tensors_in_flight.max(1))
            .try_collect::<Vec<()>>();
        futures::try_join!(format.read_many_into(&ctx, in_place), assembled)?;
        Ok(manifest)
    }
}
