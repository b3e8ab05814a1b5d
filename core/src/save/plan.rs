//! The plan of a distributed save: which rank writes which tensor.
//!
//! Rank 0 computes it from the distinct tables of what ranks hold
//! ([`crate::layout::index::Table`], each with the ranks that hold it), and
//! sends every rank only the owners of replicated items, O(tensors) bytes
//! whatever the job's size:
//!
//! - a chunk of a sharded tensor (`Placement::Chunk`) is its holder's alone,
//!   and so is a tensor or piece only one rank holds: written by the holder;
//! - a tensor several ranks hold unsharded (data parallelism), or a piece
//!   several ranks hold at the same offsets (a DTensor replicated over one
//!   mesh dimension and sharded over another), is *replicated*: one holder
//!   writes it. Replicated items are assigned largest first, each to the holder
//!   with the fewest bytes so far (ties to the lowest rank), so every rank
//!   writes about 1/N of the bytes and the assignment is deterministic.

use std::collections::BTreeMap;

use crate::error::{Error, Result};
use crate::layout::index::{Entry, Item, Placement, Table};

/// The assignment of a save.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Plan {
    /// The writer of each replicated item (held by several ranks).
    pub owners: BTreeMap<Item, u32>,
    /// Per rank, the bytes it writes.
    pub bytes: Vec<u64>,
}

/// Does `rank` write `entry`, given the owners of replicated items?
pub fn writes(owners: &BTreeMap<Item, u32>, rank: u32, entry: &Entry) -> bool {
    match item(entry) {
        None => true,
        Some(key) => owners.get(&key).is_none_or(|&w| w == rank),
    }
}

/// The item an entry is, or `None` for a chunk or a rank's own state (its
/// holder's alone).
fn item(e: &Entry) -> Option<Item> {
    match &e.placement {
        Placement::Whole => Some((e.name.clone(), None)),
        Placement::Chunk { .. } | Placement::Own => None,
        Placement::Box { offsets, .. } => Some((e.name.clone(), Some(offsets.clone()))),
    }
}

/// Compute the plan from the distinct tables, each with the ranks (ascending)
/// that hold it, in a job of `world` ranks.
pub fn make(groups: &[(&Table, &[u32])], world: usize) -> Result<Plan> {
    let mut bytes = vec![0u64; world];
    // item -> (bytes, holders)
    let mut items: BTreeMap<Item, (u64, Vec<u32>)> = BTreeMap::new();
    for (table, ranks) in groups {
        for e in table.iter() {
            let Some(key) = item(e) else {
                for &r in ranks.iter() {
                    bytes[r as usize] += e.bytes;
                }
                continue;
            };
            let slot = items.entry(key).or_insert((e.bytes, Vec::new()));
            if slot.0 != e.bytes {
                return Err(Error::InvalidInput(format!(
                    "tensor `{}` is held by several ranks with different sizes ({} and {} bytes); \
                     give rank-local state rank-specific names",
                    e.name, slot.0, e.bytes
                )));
            }
            slot.1.extend_from_slice(ranks);
        }
    }
    let mut replicated: Vec<(Item, u64, Vec<u32>)> = Vec::new();
    for (key, (b, holders)) in items {
        if let [only] = holders[..] {
            bytes[only as usize] += b;
        } else {
            replicated.push((key, b, holders));
        }
    }
    replicated.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
    let mut owners = BTreeMap::new();
    for (key, b, holders) in replicated {
        let r = *holders
            .iter()
            .min_by_key(|&&r| (bytes[r as usize], r))
            .expect("at least two holders");
        bytes[r as usize] += b;
        owners.insert(key, r);
    }
    Ok(Plan { owners, bytes })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::dtype::DType;

    fn h(name: &str, bytes: u64) -> Entry {
        Entry {
            name: name.into(),
            dtype: DType::U8,
            shape: vec![bytes],
            bytes,
            placement: Placement::Whole,
        }
    }

    fn piece(name: &str, bytes: u64, offsets: &[u64]) -> Entry {
        Entry {
            name: name.into(),
            dtype: DType::U8,
            shape: vec![1000, 1000],
            bytes,
            placement: Placement::Box {
                offsets: offsets.to_vec(),
                shape: vec![bytes, 1],
            },
        }
    }

    /// Groups of one rank each.
    fn each(tables: &[Table]) -> Result<Plan> {
        let ranks: Vec<[u32; 1]> = (0..tables.len() as u32).map(|r| [r]).collect();
        let groups: Vec<(&Table, &[u32])> = tables
            .iter()
            .zip(&ranks)
            .map(|(t, r)| (t, &r[..]))
            .collect();
        make(&groups, tables.len())
    }

    fn writers(plan: &Plan, tables: &[Table], name: &str) -> Vec<u32> {
        (0..tables.len() as u32)
            .filter(|&r| {
                tables[r as usize]
                    .iter()
                    .any(|e| e.name == name && writes(&plan.owners, r, e))
            })
            .collect()
    }

    #[test]
    fn replicated_tensors_are_written_once_and_balanced() {
        let all: Table = (0..8).map(|i| h(&format!("w{i}"), 100)).collect();
        let ranks = [0, 1, 2, 3];
        let plan = make(&[(&all, &ranks[..])], 4).unwrap();
        assert_eq!(plan.bytes, vec![200, 200, 200, 200]);
        assert_eq!(plan.owners.len(), 8);
        // Deterministic, and the same whether ranks come grouped or one by one.
        let tables = vec![all.clone(), all.clone(), all.clone(), all];
        assert_eq!(plan, each(&tables).unwrap());
        for i in 0..8 {
            assert_eq!(writers(&plan, &tables, &format!("w{i}")).len(), 1);
        }
    }

    #[test]
    fn chunks_and_local_state_stay_with_their_holder() {
        let chunk = |r| Entry {
            name: "emb".into(),
            dtype: DType::U8,
            shape: vec![2000],
            bytes: 1000,
            placement: Placement::Chunk { dim: r },
        };
        let tables = vec![
            vec![chunk(0), h("rng.0", 10), h("bias", 50)],
            vec![chunk(0), h("rng.1", 10), h("bias", 50)],
        ];
        let plan = each(&tables).unwrap();
        assert_eq!(writers(&plan, &tables, "emb"), vec![0, 1]);
        assert_eq!(writers(&plan, &tables, "rng.0"), vec![0]);
        assert_eq!(writers(&plan, &tables, "rng.1"), vec![1]);
        assert_eq!(writers(&plan, &tables, "bias").len(), 1);
        assert_eq!(plan.owners.len(), 1);
        assert_eq!(plan.bytes.iter().sum::<u64>(), 2070);
    }

    #[test]
    fn size_mismatch_is_refused() {
        let tables = vec![vec![h("x", 10)], vec![h("x", 12)]];
        assert!(matches!(each(&tables), Err(Error::InvalidInput(_))));
    }

    #[test]
    fn pieces_held_by_several_ranks_are_written_once() {
        // A 2x2 mesh: dim 0 of "w" sharded over mesh dim 0, replicated over mesh dim 1.
        let tables = vec![
            vec![piece("w", 400, &[0, 0]), h("b", 8)],
            vec![piece("w", 400, &[0, 0]), h("b", 8)],
            vec![piece("w", 400, &[50, 0]), h("b", 8)],
            vec![piece("w", 400, &[50, 0]), h("b", 8)],
        ];
        let plan = each(&tables).unwrap();
        let w = writers(&plan, &tables, "w");
        assert_eq!(w.len(), 2);
        assert!(w[0] < 2 && w[1] >= 2, "{w:?}");
        assert_eq!(plan.bytes.iter().sum::<u64>(), 808);
        // Distinct pieces of one tensor are each written by their holder.
        let split = vec![
            vec![piece("w", 400, &[0, 0])],
            vec![piece("w", 400, &[50, 0])],
        ];
        let plan = each(&split).unwrap();
        assert_eq!(writers(&plan, &split, "w"), vec![0, 1]);
        assert!(plan.owners.is_empty());
    }
}
