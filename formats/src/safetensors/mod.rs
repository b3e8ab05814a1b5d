//! The safetensors format: one `.safetensors` file per rank plus an index in the
//! `model.safetensors.index.json` convention, so that `safetensors.torch.load_file`
//! (and the Hugging Face sharded loaders) open a checkpoint without ckpt.
//!
//! ```text
//! data/<step>-<attempt>/model-rank00000.safetensors
//! data/<step>-<attempt>/model.safetensors.index.json   {"metadata": {"total_size": N}, "weight_map": {name: file}}
//! ```
//!
//! Each tensor is a [`ckpt_core::Layout::Range`] of its rank's file with its blake3,
//! so loading through the engine verifies every tensor. The tensor bytes are
//! uploaded as they are (no copy); only the header is built.
//!
//! Non-tensor state lives in the ckpt manifest; [`codec::encode`] (used by
//! `ckpt convert` for standalone files) also puts it in the header's `__metadata__`.

pub mod codec;
pub mod index;
pub(crate) mod ranged;

use std::time::Instant;

use async_trait::async_trait;
use bytes::Bytes;
use ckpt_core::format::io::put_object;
use ckpt_core::{Format, Layout, Result, Tensor, TensorRecord, Value, WriteContext, WriteOutput};

pub use codec::read_file;

/// Name of the index file written next to the rank files.
pub const INDEX_FILE: &str = "model.safetensors.index.json";

/// The safetensors format.
#[derive(Debug, Clone, Default)]
pub struct Safetensors;

#[async_trait]
impl Format for Safetensors {
    fn name(&self) -> &'static str {
        "safetensors"
    }

    async fn write(&self, ctx: &WriteContext, tensors: &[Tensor]) -> Result<WriteOutput> {
        let start = Instant::now();
        let entries: Vec<codec::Entry<'_>> = tensors.iter().map(codec::Entry::from).collect();
        let header = codec::encode_header(
            &entries,
            Some(
                codec::file_metadata(if ctx.world_size == 1 {
                    &ctx.meta
                } else {
                    &Value::Null
                })
                .map_err(internal)?,
            ),
        )
        .map_err(|e| ckpt_core::Error::InvalidInput(format!("safetensors header: {e}")))?;
        ctx.stats.add_encode_time(start.elapsed());
        let hashes = ranged::hash_tensors(ctx, tensors).await?;

        let file = ranged::rank_file(ctx.rank, "safetensors");
        let key = ctx.data_prefix.clone().join(file.as_str());
        let mut parts = Vec::with_capacity(tensors.len() + 1);
        parts.push(Bytes::from(header.bytes));
        parts.extend(
            tensors
                .iter()
                .filter(|t| !t.data.is_empty())
                .map(|t| t.data.clone()),
        );
        put_object(ctx, &key, parts).await?;
        let records = ranged::range_records(tensors, key.as_ref(), &header.offsets, hashes);
        Ok(WriteOutput {
            records,
            objects: vec![key.to_string()],
        })
    }

    /// Rank 0 writes the index over every rank's file. Pieces of sharded tensors
    /// have no place in the index convention (it maps whole tensors to files), so
    /// only unsharded tensors are listed; the ckpt manifest has all of them.
    fn finish_reads_records(&self) -> bool {
        true
    }

    async fn finish(&self, ctx: &WriteContext, records: &[TensorRecord]) -> Result<Vec<String>> {
        let mut total = 0u64;
        let mut map = Vec::new();
        for r in records.iter().filter(|r| r.shard.is_none()) {
            if let Layout::Range { object, len, .. } = &r.layout {
                total += len;
                let file = object.rsplit('/').next().unwrap_or(object).to_owned();
                map.push((r.name.clone(), file));
            }
        }
        let json = index::Index::new(total, map).to_json().map_err(internal)?;
        let index_key = ctx.data_prefix.clone().join(INDEX_FILE);
        put_object(ctx, &index_key, vec![Bytes::from(json)]).await?;
        Ok(vec![index_key.to_string()])
    }
}

fn internal(e: crate::CodecError) -> ckpt_core::Error {
    ckpt_core::Error::Internal(e.to_string())
}
