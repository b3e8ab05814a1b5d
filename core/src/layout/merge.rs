//! One manifest from the manifests that several ranks committed alone for the
//! same step, as if they had saved it together.
//!
//! The memory tier keeps each rank's state as a checkpoint of that rank alone
//! (its own root, its own manifest). A job restarted with another number of
//! ranks needs the union: the pieces of every sharded tensor, with their
//! offsets, and one copy of each tensor that several ranks hold (data-parallel
//! replicas). [`merge_ranks`] builds it, and a load then reads only the pieces
//! that overlap each new rank's shards, as from any coordinated checkpoint.
//!
//! Replicas follow the rule of a coordinated save (`save::plan`): a tensor that
//! several ranks hold whole under one name, or a piece several hold at the same
//! offsets, is one value, stored once; the lowest rank's copy is kept. Pure and
//! checked: records under one name that disagree in dtype, shape or placement
//! cannot be merged, an [`Error::InvalidInput`].

use std::collections::{HashMap, HashSet};

use crate::error::{Error, Result};
use crate::layout::manifest::{Manifest, TensorRecord};

/// What identifies a tensor record in a merged checkpoint: its name, and for
/// a piece of a sharded tensor, its offsets.
type Key = (String, Option<Vec<u64>>);

/// The manifest of the checkpoint that `parts` (manifests of the same step,
/// one per rank, in rank order) make together: every tensor record once, rank
/// 0's metadata, every per-checkpoint object, and the ranks' total world size.
pub fn merge_ranks(parts: &[Manifest]) -> Result<Manifest> {
    let first = parts
        .first()
        .ok_or_else(|| Error::InvalidInput("no manifests to merge".into()))?;
    let mut tensors: Vec<TensorRecord> = Vec::new();
    // Where each record is, and which rank it came from.
    let mut seen: HashMap<Key, (usize, usize)> = HashMap::new();
    let mut objects: Vec<String> = Vec::new();
    let mut listed: HashSet<&str> = HashSet::new();
    let mut world_size = 0u32;
    for (rank, part) in parts.iter().enumerate() {
        if part.has_fragments() {
            return Err(Error::InvalidInput(format!(
                "rank {rank}'s checkpoint keeps its records in fragments; only manifests that hold them can be merged"
            )));
        }
        if part.step != first.step || part.format != first.format || part.version != first.version {
            return Err(Error::InvalidInput(format!(
                "rank {rank}'s checkpoint (step {}, format {}) does not belong with rank 0's (step {}, format {})",
                part.step, part.format, first.step, first.format
            )));
        }
        world_size = world_size
            .checked_add(part.world_size)
            .ok_or_else(|| Error::InvalidInput("the ranks' world sizes overflow".into()))?;
        for t in &part.tensors {
            let key = (t.name.clone(), t.shard.as_ref().map(|s| s.offsets.clone()));
            match seen.get(&key) {
                None => {
                    seen.insert(key, (rank, tensors.len()));
                    tensors.push(t.clone());
                }
                // A replica of what a lower rank holds: stored once.
                Some(&(_, at)) if same_placement(&tensors[at], t) => {}
                Some(&(holder, _)) => {
                    return Err(Error::InvalidInput(format!(
                        "ranks {holder} and {rank} hold tensor `{}`{} with different dtypes, shapes or placements",
                        t.name,
                        t.shard
                            .as_ref()
                            .map(|s| format!(" at offsets {:?}", s.offsets))
                            .unwrap_or_default()
                    )));
                }
            }
        }
        for o in &part.objects {
            if listed.insert(o.as_str()) {
                objects.push(o.clone());
            }
        }
    }
    let merged = Manifest {
        version: first.version,
        library: first.library.clone(),
        format: first.format.clone(),
        step: first.step,
        attempt: first.attempt.clone(),
        world_size,
        created_unix_ms: parts.iter().map(|p| p.created_unix_ms).max().unwrap_or(0),
        epoch: 0,
        tensors,
        meta: first.meta.clone(),
        objects,
        fragments: Vec::new(),
        index: Vec::new(),
    };
    merged.validate()?;
    Ok(merged)
}

/// The same dtype, shape and placement: one value held by several ranks.
fn same_placement(a: &TensorRecord, b: &TensorRecord) -> bool {
    a.dtype == b.dtype && a.shape == b.shape && a.shard == b.shard
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::manifest::{ChunkRef, Layout, MANIFEST_VERSION_INLINE};
    use crate::model::dtype::DType;
    use crate::model::tensor::ShardSpec;
    use crate::model::value::Value;

    fn record(name: &str, shape: u64, shard: Option<(u64, u64)>, hash: char) -> TensorRecord {
        TensorRecord {
            name: name.into(),
            dtype: DType::F32,
            shape: vec![shape],
            shard: shard.map(|(global, offset)| ShardSpec {
                global_shape: vec![global],
                offsets: vec![offset],
            }),
            layout: Layout::Chunks {
                chunks: vec![ChunkRef {
                    hash: hash.to_string().repeat(64),
                    len: shape * 4,
                    stored: shape * 4 + 16,
                    offset: None,
                }],
            },
        }
    }

    fn part(step: u64, attempt: &str, meta: i64, tensors: Vec<TensorRecord>) -> Manifest {
        Manifest {
            version: MANIFEST_VERSION_INLINE,
            library: "ckpt test".into(),
            format: "native".into(),
            step,
            attempt: attempt.into(),
            world_size: 1,
            created_unix_ms: meta as u64,
            epoch: 0,
            tensors,
            meta: Value::Int(meta),
            objects: vec![format!("data/{attempt}/x")],
            fragments: vec![],
            index: vec![],
        }
    }

    fn names(m: &Manifest) -> Vec<(String, Option<Vec<u64>>, String)> {
        m.tensors
            .iter()
            .map(|t| {
                let Layout::Chunks { chunks } = &t.layout else {
                    unreachable!()
                };
                (
                    t.name.clone(),
                    t.shard.as_ref().map(|s| s.offsets.clone()),
                    chunks[0].hash[..1].to_owned(),
                )
            })
            .collect()
    }

    #[test]
    fn replicas_once_pieces_all_and_rank_zeros_metadata() {
        let r0 = part(
            5,
            "a0",
            10,
            vec![
                record("w", 2, None, 'a'),
                record("s", 2, Some((4, 0)), 'b'),
                record("rep", 2, Some((4, 2)), 'c'),
                record("__rank0__", 3, None, 'd'),
            ],
        );
        let r1 = part(
            5,
            "a1",
            11,
            vec![
                // The same replica, packed elsewhere on this rank: rank 0's copy stays.
                record("w", 2, None, 'e'),
                record("s", 2, Some((4, 2)), 'f'),
                record("rep", 2, Some((4, 2)), 'c'),
                record("__rank1__", 3, None, '1'),
            ],
        );
        let m = merge_ranks(&[r0, r1]).unwrap();
        let n = |s: &str, o: Option<u64>, h: &str| (s.to_owned(), o.map(|o| vec![o]), h.to_owned());
        assert_eq!(
            names(&m),
            vec![
                n("w", None, "a"),
                n("s", Some(0), "b"),
                n("rep", Some(2), "c"),
                n("__rank0__", None, "d"),
                n("s", Some(2), "f"),
                n("__rank1__", None, "1"),
            ]
        );
        assert_eq!((m.step, m.world_size, m.attempt.as_str()), (5, 2, "a0"));
        assert_eq!(m.meta, Value::Int(10));
        assert_eq!(m.created_unix_ms, 11);
        assert_eq!(m.objects, vec!["data/a0/x", "data/a1/x"]);
        // What the merge makes is a manifest like any other.
        let back = Manifest::decode(&m.encode().unwrap(), "merged").unwrap();
        assert_eq!(back, m);
    }

    #[test]
    fn disagreeing_ranks_other_steps_and_nothing_are_errors() {
        let a = part(5, "a", 0, vec![record("w", 2, None, 'a')]);
        let wider = part(5, "b", 0, vec![record("w", 3, None, 'a')]);
        let sharded = part(5, "b", 0, vec![record("w", 2, Some((4, 0)), 'a')]);
        let later = part(6, "b", 0, vec![record("w", 2, None, 'a')]);
        for other in [wider, later] {
            let e = merge_ranks(&[a.clone(), other]).unwrap_err();
            assert!(matches!(e, Error::InvalidInput(_)), "{e}");
        }
        // One name, whole on one rank and a piece on another: no such checkpoint.
        assert!(matches!(
            merge_ranks(&[a.clone(), sharded]),
            Err(Error::InvalidInput(_))
        ));
        assert!(matches!(merge_ranks(&[]), Err(Error::InvalidInput(_))));
        assert_eq!(merge_ranks(std::slice::from_ref(&a)).unwrap(), a);
    }
}
