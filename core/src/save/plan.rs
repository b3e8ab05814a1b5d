//! The plan of a distributed save: which rank writes which tensor.
//!
//! Every rank contributes the list of its tensors (name, bytes, sharded or not,
//! and a piece's offsets); every rank then computes the same plan from the same
//! lists, so no further message is needed:
//!
//! - a tensor, or a piece of a sharded tensor, that only one rank holds is
//!   written by its holder;
//! - a tensor several ranks hold unsharded (data parallelism), or a piece several
//!   ranks hold at the same offsets (a DTensor replicated over one mesh dimension
//!   and sharded over another), is *replicated*: one holder writes it. Replicated
//!   items are assigned largest first, each to the holder with the fewest bytes
//!   so far (ties to the lowest rank), so every rank writes about 1/N of the bytes
//!   and the assignment is deterministic.

use std::collections::{BTreeMap, HashSet};

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// What one rank holds.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Holding {
    /// Tensor name.
    pub name: String,
    /// Bytes.
    pub bytes: u64,
    /// True for a piece of a sharded tensor.
    pub sharded: bool,
    /// A sharded piece's offsets in its global tensor; pieces of one name at the
    /// same offsets on several ranks are the same data, written once. `None`
    /// (older peers) means the holder always writes it.
    #[serde(default)]
    pub offsets: Option<Vec<u64>>,
}

/// What the plan assigns: a whole tensor, or one piece of a sharded one.
type Item = (String, Option<Vec<u64>>);

/// The assignment of a save.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Plan {
    /// Per rank, the tensors (name, and a piece's offsets) it writes. Sharded
    /// pieces held without offsets are always written by their holder and are
    /// not listed.
    pub writes: Vec<HashSet<Item>>,
    /// Per rank, the bytes it writes.
    pub bytes: Vec<u64>,
    /// Names of replicated tensors (held by more than one rank, whole or as the
    /// same piece).
    pub replicated: HashSet<String>,
}

impl Plan {
    /// Does `rank` write this tensor (`offsets`: a sharded piece's, or `None`
    /// for a whole tensor)?
    pub fn writes(&self, rank: usize, name: &str, sharded: bool, offsets: Option<&[u64]>) -> bool {
        if sharded && offsets.is_none() {
            return true;
        }
        let item = (name.to_owned(), offsets.map(<[u64]>::to_vec));
        self.writes.get(rank).is_some_and(|w| w.contains(&item))
    }
}

/// Compute the plan from every rank's holdings (index = rank).
pub fn make(ranks: &[Vec<Holding>]) -> Result<Plan> {
    let n = ranks.len();
    let mut plan = Plan {
        writes: vec![HashSet::new(); n],
        bytes: vec![0; n],
        replicated: HashSet::new(),
    };
    // item -> (bytes, holders)
    let mut items: BTreeMap<Item, (u64, Vec<usize>)> = BTreeMap::new();
    for (r, holdings) in ranks.iter().enumerate() {
        for h in holdings {
            if h.sharded && h.offsets.is_none() {
                plan.bytes[r] += h.bytes;
                continue;
            }
            let key = (h.name.clone(), h.offsets.clone().filter(|_| h.sharded));
            let e = items.entry(key).or_insert((h.bytes, Vec::new()));
            if e.0 != h.bytes {
                return Err(Error::InvalidInput(format!(
                    "tensor `{}` is held by several ranks with different sizes ({} and {} bytes); \
                     give rank-local state rank-specific names",
                    h.name, e.0, h.bytes
                )));
            }
            if e.1.last() != Some(&r) {
                e.1.push(r);
            }
        }
    }
    let mut replicated: Vec<(Item, u64, Vec<usize>)> = Vec::new();
    for (item, (bytes, holders)) in items {
        if holders.len() == 1 {
            plan.bytes[holders[0]] += bytes;
            plan.writes[holders[0]].insert(item);
        } else {
            plan.replicated.insert(item.0.clone());
            replicated.push((item, bytes, holders));
        }
    }
    replicated.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
    for (item, bytes, holders) in replicated {
        let r = *holders
            .iter()
            .min_by_key(|&&r| (plan.bytes[r], r))
            .expect("at least two holders");
        plan.bytes[r] += bytes;
        plan.writes[r].insert(item);
    }
    Ok(plan)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h(name: &str, bytes: u64, sharded: bool) -> Holding {
        Holding {
            name: name.into(),
            bytes,
            sharded,
            offsets: None,
        }
    }

    fn piece(name: &str, bytes: u64, offsets: &[u64]) -> Holding {
        Holding {
            name: name.into(),
            bytes,
            sharded: true,
            offsets: Some(offsets.to_vec()),
        }
    }

    #[test]
    fn replicated_tensors_are_written_once_and_balanced() {
        let all: Vec<Holding> = (0..8).map(|i| h(&format!("w{i}"), 100, false)).collect();
        let ranks = vec![all.clone(), all.clone(), all.clone(), all];
        let plan = make(&ranks).unwrap();
        assert_eq!(plan.bytes, vec![200, 200, 200, 200]);
        let mut seen = HashSet::new();
        for w in &plan.writes {
            for n in w {
                assert!(seen.insert(n.clone()), "{n:?} written twice");
            }
        }
        assert_eq!(seen.len(), 8);
        // Deterministic: the same input gives the same plan.
        assert_eq!(plan, make(&ranks).unwrap());
    }

    #[test]
    fn shards_and_local_state_stay_with_their_holder() {
        let ranks = vec![
            vec![
                h("emb", 1000, true),
                h("rng.0", 10, false),
                h("bias", 50, false),
            ],
            vec![
                h("emb", 1000, true),
                h("rng.1", 10, false),
                h("bias", 50, false),
            ],
        ];
        let plan = make(&ranks).unwrap();
        assert!(plan.writes(0, "emb", true, None) && plan.writes(1, "emb", true, None));
        assert!(plan.writes(0, "rng.0", false, None) && !plan.writes(1, "rng.0", false, None));
        assert!(plan.writes(1, "rng.1", false, None));
        assert_eq!(plan.replicated, HashSet::from(["bias".to_owned()]));
        assert_eq!(plan.bytes.iter().sum::<u64>(), 2070);
    }

    #[test]
    fn size_mismatch_is_refused() {
        let ranks = vec![vec![h("x", 10, false)], vec![h("x", 12, false)]];
        assert!(matches!(make(&ranks), Err(Error::InvalidInput(_))));
    }

    #[test]
    fn pieces_held_by_several_ranks_are_written_once() {
        // A 2x2 mesh: dim 0 of "w" sharded over mesh dim 0, replicated over mesh dim 1.
        let ranks = vec![
            vec![piece("w", 400, &[0, 0]), h("b", 8, false)],
            vec![piece("w", 400, &[0, 0]), h("b", 8, false)],
            vec![piece("w", 400, &[50, 0]), h("b", 8, false)],
            vec![piece("w", 400, &[50, 0]), h("b", 8, false)],
        ];
        let plan = make(&ranks).unwrap();
        let writers = |off: &[u64]| {
            (0..4)
                .filter(|&r| plan.writes(r, "w", true, Some(off)))
                .collect::<Vec<_>>()
        };
        assert_eq!(writers(&[0, 0]).len(), 1);
        assert_eq!(writers(&[50, 0]).len(), 1);
        assert!(writers(&[0, 0])[0] < 2 && writers(&[50, 0])[0] >= 2);
        assert_eq!(plan.bytes.iter().sum::<u64>(), 808);
        assert!(plan.replicated.contains("w"));
        // Distinct pieces of one tensor are each written by their holder.
        let split = vec![
            vec![piece("w", 400, &[0, 0])],
            vec![piece("w", 400, &[50, 0])],
        ];
        let plan = make(&split).unwrap();
        assert!(plan.writes(0, "w", true, Some(&[0, 0])));
        assert!(plan.writes(1, "w", true, Some(&[50, 0])));
        assert!(!plan.writes(1, "w", true, Some(&[0, 0])));
        assert!(plan.replicated.is_empty());
    }
}
