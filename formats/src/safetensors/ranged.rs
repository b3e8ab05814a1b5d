//! Helpers shared by the single-file formats (safetensors, `.pt`, HDF5): each tensor
//! is a byte range of one object, hashed with blake3 so that loading verifies it
//! whatever the file format.

use std::time::Instant;

use bytes::Bytes;
use ckpt_core::{Layout, Result, Tensor, TensorRecord, WriteContext};
use futures::{StreamExt, TryStreamExt};

// CPU work (hashing) runs within the process's CPU budget.
pub(crate) use ckpt_core::budget::run_cpu as blocking;

/// blake3 (hex) of every tensor, computed on blocking threads, `concurrency` at a time.
pub(crate) async fn hash_tensors(ctx: &WriteContext, tensors: &[Tensor]) -> Result<Vec<String>> {
    let start = Instant::now();
    let datas: Vec<Bytes> = tensors.iter().map(|t| t.data.clone()).collect();
    let hashes: Vec<String> = futures::stream::iter(datas)
        .map(|d| blocking(move || blake3::hash(&d).to_hex().to_string()))
        .buffered(ctx.options.concurrency.max(1))
        .try_collect()
        .await?;
    ctx.stats.add_hash_time(start.elapsed());
    let raw: u64 = tensors.iter().map(|t| t.data.len() as u64).sum();
    ctx.stats.add_raw(raw);
    Ok(hashes)
}

/// One [`Layout::Range`] record per tensor, at `offsets[i]` in `object`.
pub(crate) fn range_records(
    tensors: &[Tensor],
    object: &str,
    offsets: &[u64],
    hashes: Vec<String>,
) -> Vec<TensorRecord> {
    tensors
        .iter()
        .zip(offsets)
        .zip(hashes)
        .map(|((t, &offset), blake3)| TensorRecord {
            name: t.name.clone(),
            dtype: t.dtype,
            shape: t.shape.clone(),
            shard: t.shard.clone(),
            layout: Layout::Range {
                object: object.to_owned(),
                offset,
                len: t.data.len() as u64,
                blake3,
            },
        })
        .collect()
}

/// File name of one rank's file: `model-rank00003.<ext>`.
pub(crate) fn rank_file(rank: usize, ext: &str) -> String {
    format!("model-rank{rank:05}.{ext}")
}
