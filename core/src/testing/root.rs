//! The root a commit publishes for a job too large to save in one process:
//! what the scale experiment reports at 16,384 ranks of 1,600 tensors.
//!
//! Every rank of the job is taken to hold a table equal to rank 0's (as an
//! FSDP job's ranks do: chunks, replicas and own state are rank-invariant),
//! so rank 0's `tensors` stand for all. The plan, the index and the manifest
//! encoding are the commit's own code; what is simulated is only the ranks'
//! saves: each rank's fragment reference carries a hash and `fragment_len`,
//! and the replicas' records are those a save would send rank 0 (one record
//! per replicated tensor, of one chunk each).

use std::time::{SystemTime, UNIX_EPOCH};

use crate::error::Result;
use crate::layout::index::{self, Placement};
use crate::layout::manifest::{ChunkRef, Layout, Manifest, TensorRecord, MANIFEST_VERSION};
use crate::layout::FragmentRef;
use crate::model::Tensor;
use crate::save::plan;

/// The encoded root of a checkpoint of `world` ranks that each hold what
/// rank 0's `tensors` are.
pub fn root_of(tensors: &[Tensor], world: usize, fragment_len: u64) -> Result<Vec<u8>> {
    let table = index::table_of(tensors, 0, world);
    let ranks: Vec<u32> = (0..world as u32).collect();
    let groups = [(&table, &ranks[..])];
    let made = plan::make(&groups, world)?;
    let entries = index::build(&groups, &made.owners, world as u32)?;
    let hash = |what: &str| blake3::hash(what.as_bytes()).to_hex().to_string();
    let replicas: Vec<TensorRecord> = table
        .iter()
        .filter(|e| e.placement == Placement::Whole && index::in_root(&made.owners, e))
        .map(|e| TensorRecord {
            name: e.name.clone(),
            dtype: e.dtype,
            shape: e.shape.clone(),
            shard: None,
            layout: Layout::Chunks {
                chunks: vec![ChunkRef {
                    hash: hash(&e.name),
                    len: e.bytes,
                    stored: e.bytes,
                    offset: None,
                }],
            },
        })
        .collect();
    let m = Manifest {
        version: MANIFEST_VERSION,
        library: concat!("ckpt ", env!("CARGO_PKG_VERSION")).to_owned(),
        format: "native".into(),
        step: 1,
        attempt: "0123456789abcdef".into(),
        world_size: world as u32,
        created_unix_ms: SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default()
            .as_millis() as u64,
        epoch: 1,
        tensors: replicas,
        meta: crate::Value::Null,
        objects: Vec::new(),
        index: entries,
        fragments: (0..world as u32)
            .map(|rank| FragmentRef {
                rank,
                blake3: hash(&rank.to_string()),
                len: fragment_len,
            })
            .collect(),
    };
    m.validate()?;
    m.encode()
}
