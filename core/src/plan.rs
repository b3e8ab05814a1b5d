//! The plan of a distributed save: which rank writes which tensor.
//!
//! Every rank contributes the list of its tensors (name, bytes, sharded or not);
//! every rank then computes the same plan from the same lists, so no further
//! message is needed:
//!
//! - a sharded piece, and a tensor only one rank holds, is written by its holder;
//! - a tensor several ranks hold unsharded (data parallelism) is *replicated*: one
//!   holder writes it. Replicated tensors are assigned largest first, each to the
//!   holder with the fewest bytes so far (ties to the lowest rank), so every rank
//!   writes about 1/N of the bytes and the assignment is deterministic.

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
}

/// The assignment of a save.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Plan {
    /// Per rank, the names of the unsharded tensors it writes (sharded pieces are
    /// always written by their holder and are not listed).
    pub writes: Vec<HashSet<String>>,
    /// Per rank, the bytes it writes.
    pub bytes: Vec<u64>,
    /// Names of replicated tensors (held by more than one rank).
    pub replicated: HashSet<String>,
}

impl Plan {
    /// Does `rank` write this tensor?
    pub fn writes(&self, rank: usize, name: &str, sharded: bool) -> bool {
        sharded || self.writes.get(rank).is_some_and(|w| w.contains(name))
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
    // name -> (bytes, holders)
    let mut unsharded: BTreeMap<&str, (u64, Vec<usize>)> = BTreeMap::new();
    for (r, holdings) in ranks.iter().enumerate() {
        for h in holdings {
            if h.sharded {
                plan.bytes[r] += h.bytes;
                continue;
            }
            let e = unsharded
                .entry(h.name.as_str())
                .or_insert((h.bytes, Vec::new()));
            if e.0 != h.bytes {
                return Err(Error::InvalidInput(format!(
                    "tensor `{}` is held by several ranks with different sizes ({} and {} bytes); \
                     give rank-local state rank-specific names",
                    h.name, e.0, h.bytes
                )));
            }
            e.1.push(r);
        }
    }
    let mut replicated: Vec<(&str, u64, Vec<usize>)> = Vec::new();
    for (name, (bytes, holders)) in unsharded {
        if holders.len() == 1 {
            plan.bytes[holders[0]] += bytes;
            plan.writes[holders[0]].insert(name.to_owned());
        } else {
            plan.replicated.insert(name.to_owned());
            replicated.push((name, bytes, holders));
        }
    }
    replicated.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(b.0)));
    for (name, bytes, holders) in replicated {
        let r = *holders
            .iter()
            .min_by_key(|&&r| (plan.bytes[r], r))
            .expect("at least two holders");
        plan.bytes[r] += bytes;
        plan.writes[r].insert(name.to_owned());
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
                assert!(seen.insert(n.clone()), "{n} written twice");
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
        assert!(plan.writes(0, "emb", true) && plan.writes(1, "emb", true));
        assert!(plan.writes(0, "rng.0", false) && !plan.writes(1, "rng.0", false));
        assert!(plan.writes(1, "rng.1", false));
        assert_eq!(plan.replicated, HashSet::from(["bias".to_owned()]));
        assert_eq!(plan.bytes.iter().sum::<u64>(), 2070);
    }

    #[test]
    fn size_mismatch_is_refused() {
        let ranks = vec![vec![h("x", 10, false)], vec![h("x", 12, false)]];
        assert!(matches!(make(&ranks), Err(Error::InvalidInput(_))));
    }
}
