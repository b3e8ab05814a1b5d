//! How the ranks of a save agree on its plan, sending each other O(1) bytes
//! when they hold what they held at the last save.
//!
//! ```text
//!  every rank                               rank 0
//!  gather(step, attempt, digest of table) ─► same plan as last time? ─ yes ─┐
//!                                            tables it lacks, by digest      │
//!  broadcast(need: ranks) ◄──────────────── (one rank per unknown digest)    │
//!  gather(table, if asked) ───────────────► plan (plan.rs), index (index.rs) │
//!  broadcast(go: owners of replicated items, or "unchanged") ◄───────────────┘
//! ```
//!
//! A rank's table is rank-invariant for FSDP (chunks are described by their
//! dimension, not offsets), so rank 0 receives one table however many ranks
//! there are; a repeated save is one gather of digests and one broadcast.
//! Every rank takes part in every step even after its own part failed (it
//! sends the error), and rank 0 turns any failure into one reply that every
//! rank raises alike.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use crate::checkpointer::Checkpointer;
use crate::coord::Coordinator;
use crate::error::wire::WireError;
use crate::error::{Error, Result};
use crate::layout::index::{self, IndexEntry, Item, Table};
use crate::model::CheckpointId;
use crate::save::plan;
use crate::sync::MutexExt;

/// What every rank sends rank 0 first.
#[derive(Debug, Serialize, Deserialize)]
struct Offer {
    step: u64,
    attempt: String,
    /// The digest of this rank's table, or why it has none.
    table: std::result::Result<String, WireError>,
    /// The plan this rank holds (0: none).
    plan: u64,
    /// A digest of this rank's metadata (only rank 0's is stored).
    meta: Option<String>,
    /// A fingerprint of the contents of the tensors it may share with other
    /// ranks ([`fingerprint`]): ranks of one table must agree on it.
    #[serde(default)]
    same: Option<String>,
}

/// What a rank holds that other ranks may hold under the same names (whole
/// tensors and boxes, not chunks or own state): a fingerprint of each one's
/// contents (its length and up to 4 KiB at its start, middle and end), and
/// one of them all. Ranks that hold the same names must hold the same data,
/// since one copy is stored; a per-rank batch saved under one name would
/// differ here. Only `all` travels with every save; `each` is sent when
/// ranks differ, so the error can name the tensors.
pub(crate) struct Fingerprint {
    /// Of every tensor below, by name.
    pub all: String,
    /// Per tensor (a box per piece), sorted by name.
    pub each: Vec<(String, String)>,
}

/// The [`Fingerprint`] of `tensors` on rank `rank` of `world`.
pub(crate) fn fingerprint(
    tensors: &[crate::model::tensor::Tensor],
    rank: usize,
    world: usize,
) -> Fingerprint {
    const SAMPLE: usize = 4096;
    let mut sampled: Vec<(&str, &[u8])> = tensors
        .iter()
        .filter(|t| {
            matches!(
                index::entry_of(t, rank, world).placement,
                index::Placement::Whole | index::Placement::Box { .. }
            )
        })
        .map(|t| (t.name.as_str(), &t.data[..]))
        .collect();
    sampled.sort_by(|a, b| a.0.cmp(b.0).then(a.1.len().cmp(&b.1.len())));
    let mut all = blake3::Hasher::new();
    let mut each = Vec::with_capacity(sampled.len());
    for (name, d) in sampled {
        let mut h = blake3::Hasher::new();
        h.update(&(d.len() as u64).to_le_bytes());
        let mid = d.len() / 2;
        for at in [
            0,
            mid.saturating_sub(SAMPLE / 2),
            d.len().saturating_sub(SAMPLE),
        ] {
            h.update(&d[at.min(d.len())..(at + SAMPLE).min(d.len())]);
        }
        let one = h.finalize();
        all.update(name.as_bytes());
        all.update(&(name.len() as u64).to_le_bytes());
        all.update(one.as_bytes());
        each.push((name.to_owned(), one.to_hex()[..32].to_owned()));
    }
    Fingerprint {
        all: all.finalize().to_hex().to_string(),
        each,
    }
}

/// Names of the tensors whose fingerprints differ between `a` and `b`
/// (sorted, each once).
fn differing(a: &[(String, String)], b: &[(String, String)]) -> Vec<String> {
    let group = |v: &[(String, String)]| {
        let mut m: BTreeMap<String, Vec<String>> = BTreeMap::new();
        for (n, h) in v {
            m.entry(n.clone()).or_default().push(h.clone());
        }
        m
    };
    let (a, b) = (group(a), group(b));
    let mut names: Vec<String> = a
        .iter()
        .filter(|(n, h)| b.get(*n) != Some(*h))
        .map(|(n, _)| n.clone())
        .chain(b.keys().filter(|n| !a.contains_key(*n)).cloned())
        .collect();
    names.sort();
    names.dedup();
    names
}

/// What rank 0 answers.
#[derive(Debug, Serialize, Deserialize)]
enum Reply {
    /// The save fails on every rank: rank `rank`'s error, with `context`.
    Fail {
        rank: usize,
        error: WireError,
        context: String,
    },
    /// These ranks send their tables.
    Need { ranks: Vec<u32> },
    /// These two ranks hold the same names with other contents: they send
    /// their fingerprints of each tensor, so the failure can name them.
    Explain { ranks: Vec<u32> },
    /// Write: the plan's number and, if it changed, its owners.
    Go {
        plan: u64,
        owners: Option<Vec<(Item, u32)>>,
        fence_in_ms: Option<u64>,
    },
}

/// The agreed plan, on one rank.
pub(crate) struct Agreed {
    /// Owners of replicated items.
    pub owners: Arc<BTreeMap<Item, u32>>,
    /// How long to wait before writing (a new epoch's lease).
    pub fence_in: Option<Duration>,
    /// Rank 0: the index of the checkpoint.
    pub index: Arc<Vec<IndexEntry>>,
}

fn encode<T: Serialize>(m: &T, what: &str) -> Result<Vec<u8>> {
    serde_json::to_vec(m).map_err(|e| Error::Internal(format!("{what}: {e}")))
}

fn decode<T: DeserializeOwned>(b: &[u8], what: &str) -> Result<T> {
    serde_json::from_slice(b).map_err(|e| Error::Internal(format!("{what}: bad message: {e}")))
}

/// Rank 0, with the fingerprints of each tensor of the two ranks in `ranks`
/// (gathered from every rank, empty from the others): the failure naming
/// the tensors whose contents differ.
fn explain(id: &CheckpointId, ranks: &[u32], gathered: &[Vec<u8>]) -> Reply {
    const SHOWN: usize = 8;
    let (first, r) = (ranks[0] as usize, ranks[1] as usize);
    let each = |k: usize| -> Result<Vec<(String, String)>> {
        decode(
            gathered.get(k).map(Vec::as_slice).unwrap_or_default(),
            "fingerprints",
        )
    };
    let names = match (each(first), each(r)) {
        (Ok(a), Ok(b)) => differing(&a, &b),
        (Err(e), _) | (_, Err(e)) => {
            return Reply::Fail {
                rank: 0,
                error: WireError::from(&e),
                context: String::new(),
            }
        }
    };
    let mut shown = names
        .iter()
        .take(SHOWN)
        .map(|n| format!("{n:?}"))
        .collect::<Vec<_>>()
        .join(", ");
    if names.len() > SHOWN {
        shown += &format!(" and {} more", names.len() - SHOWN);
    }
    let e = Error::InvalidInput(format!(
        "step {}: ranks {first} and {r} hold tensors of the same names whose contents differ \
         ({shown}); a tensor several ranks hold under one name is taken for a replica and \
         stored once, so state that differs per rank (a prefetched batch, a data loader's \
         position) cannot be saved under one name: save it with per_rank= (Python) or under \
         names of each rank's own",
        id.step
    ));
    Reply::Fail {
        rank: 0,
        error: WireError::from(&e),
        context: String::new(),
    }
}

impl Checkpointer {
    /// Agree on who writes what (see the module docs). `table` is this
    /// rank's, or the error that left it without one; `fence_in_ms` is rank
    /// 0's wait before writing.
    pub(crate) async fn agree_plan(
        &self,
        id: &CheckpointId,
        table: std::result::Result<&Table, &Error>,
        meta: Option<String>,
        same: Option<&Fingerprint>,
        fence_in_ms: Option<u64>,
    ) -> Result<Agreed> {
        let coord = self.coord();
        let timeout = self.options().collective_timeout;
        let held = self.plan_memo().lock_unpoisoned().plan;
        let offer = Offer {
            step: id.step,
            attempt: id.attempt.clone(),
            table: table.map(index::digest).map_err(WireError::from),
            plan: held,
            meta,
            same: same.map(|f| f.all.clone()),
        };
        let phase = || format!("save of step {}, its plan", id.step);
        let offers = coord
            .gather(encode(&offer, "plan")?, 0, timeout)
            .await
            .map_err(|e| e.during(phase()))?
            .iter()
            .map(|b| decode::<Offer>(b, "plan"))
            .collect::<Result<Vec<_>>>()?;
        let own = table.ok();
        let mut reply = Reply::Need { ranks: Vec::new() };
        if coord.rank() == 0 {
            reply = self.judge(id, &offers, fence_in_ms);
            if matches!(&reply, Reply::Need { ranks } if ranks.is_empty()) {
                reply = self.plan_from(&offers, &[], &[], own, fence_in_ms);
            }
        }
        reply = self
            .tell(coord, &reply, timeout)
            .await
            .map_err(|e| e.during(phase()))?;
        if let Reply::Explain { ranks } = &reply {
            let me = coord.rank() as u32;
            let mine = match (ranks.contains(&me), same) {
                (true, Some(f)) => encode(&f.each, "fingerprints")?,
                _ => Vec::new(),
            };
            let each = coord
                .gather(mine, 0, timeout)
                .await
                .map_err(|e| e.during(phase()))?;
            if coord.rank() == 0 {
                reply = explain(id, ranks, &each);
            }
            reply = self
                .tell(coord, &reply, timeout)
                .await
                .map_err(|e| e.during(phase()))?;
        }
        if let Reply::Need { ranks } = &reply {
            let me = coord.rank() as u32;
            let mine = match (ranks.binary_search(&me), own) {
                (Ok(_), Some(t)) => encode(t, "table")?,
                _ => Vec::new(),
            };
            let tables = coord
                .gather(mine, 0, timeout)
                .await
                .map_err(|e| e.during(phase()))?;
            if coord.rank() == 0 {
                reply = self.plan_from(&offers, ranks, &tables, own, fence_in_ms);
            }
            reply = self
                .tell(coord, &reply, timeout)
                .await
                .map_err(|e| e.during(phase()))?;
        }
        match reply {
            Reply::Fail { error, context, .. } => Err(error.into_error(&context)),
            Reply::Need { .. } => Err(Error::Internal("plan: a second request for tables".into())),
            Reply::Explain { .. } => Err(Error::Internal(
                "plan: a late request for fingerprints".into(),
            )),
            Reply::Go {
                plan,
                owners,
                fence_in_ms,
            } => {
                let mut memo = self.plan_memo().lock_unpoisoned();
                if let Some(owners) = owners {
                    memo.owners = Arc::new(owners.into_iter().collect());
                } else if memo.plan != plan {
                    return Err(Error::Internal(format!(
                        "plan: told to reuse plan {plan}, holding {}",
                        memo.plan
                    )));
                }
                memo.plan = plan;
                Ok(Agreed {
                    owners: memo.owners.clone(),
                    fence_in: fence_in_ms.map(Duration::from_millis),
                    index: memo.index.clone(),
                })
            }
        }
    }

    /// Rank 0 broadcasts `reply`; every rank returns what rank 0 sent.
    async fn tell(
        &self,
        coord: &dyn Coordinator,
        reply: &Reply,
        timeout: Duration,
    ) -> Result<Reply> {
        let b = coord.broadcast(encode(reply, "plan")?, 0, timeout).await?;
        decode(&b, "plan")
    }

    /// Rank 0, on the offers: fail, reuse the last plan, or ask for tables.
    fn judge(&self, id: &CheckpointId, offers: &[Offer], fence_in_ms: Option<u64>) -> Reply {
        let fail = |rank: usize, e: &Error, context: String| Reply::Fail {
            rank,
            error: WireError::from(e),
            context,
        };
        for (r, o) in offers.iter().enumerate() {
            if o.step != id.step || o.attempt != id.attempt {
                let e = Error::Internal(format!(
                    "ranks disagree on the save: rank {r} is at step {} (attempt {}), rank 0 at {id}; \
                     every rank must call save for the same steps in the same order",
                    o.step, o.attempt
                ));
                return fail(0, &e, String::new());
            }
        }
        // A rank that could not snapshot fails the save on every rank, as the
        // same error: its own, or the first failing rank's rebuilt.
        if let Some((r, e)) = offers
            .iter()
            .enumerate()
            .find_map(|(r, o)| o.table.as_ref().err().map(|e| (r, e)))
        {
            return Reply::Fail {
                rank: r,
                error: e.clone(),
                context: format!("rank {r} could not snapshot: "),
            };
        }
        if let Some(first) = offers.first().and_then(|o| o.meta.as_deref()) {
            let ranks: Vec<usize> = (1..offers.len())
                .filter(|&r| offers[r].meta.as_deref().is_some_and(|d| d != first))
                .collect();
            if !ranks.is_empty() {
                let e = Error::InvalidInput(format!(
                    "step {}: the metadata of rank(s) {ranks:?} differs from rank 0's; a checkpoint \
                     stores rank 0's alone and every rank loads it, so every rank must save the same \
                     metadata (the same tree of names and plain values); keep a rank's own data in \
                     tensors of names of its own",
                    id.step
                ));
                return fail(0, &e, String::new());
            }
        }
        // Ranks of one table hold the same names: the same data, or a
        // per-rank value was saved under a shared name and one copy would
        // be stored for all.
        let mut first_of: std::collections::HashMap<&str, usize> = Default::default();
        for (r, o) in offers.iter().enumerate() {
            let (Ok(d), Some(f)) = (o.table.as_ref(), o.same.as_deref()) else {
                continue;
            };
            let first = *first_of.entry(d.as_str()).or_insert(r);
            if offers[first].same.as_deref().is_some_and(|g| g != f) {
                return Reply::Explain {
                    ranks: vec![first as u32, r as u32],
                };
            }
        }
        let memo = self.plan_memo().lock_unpoisoned();
        let digests = offers.iter().map(|o| o.table.as_ref().ok());
        let same = memo.plan != 0
            && offers.iter().all(|o| o.plan == memo.plan)
            && digests.clone().eq(memo.digests.iter().map(Some));
        if same {
            return Reply::Go {
                plan: memo.plan,
                owners: None,
                fence_in_ms,
            };
        }
        // One rank per digest rank 0 has no table of (its own is local).
        let mut asked = std::collections::HashSet::new();
        let ranks = offers
            .iter()
            .enumerate()
            .skip(1)
            .filter_map(|(r, o)| {
                let d = o.table.as_ref().ok()?;
                (!memo.tables.contains_key(d)
                    && d != offers[0].table.as_ref().ok()?
                    && asked.insert(d.clone()))
                .then_some(r as u32)
            })
            .collect();
        Reply::Need { ranks }
    }

    /// Rank 0, with the tables it asked for: the plan and the index.
    fn plan_from(
        &self,
        offers: &[Offer],
        asked: &[u32],
        tables: &[Vec<u8>],
        own: Option<&Table>,
        fence_in_ms: Option<u64>,
    ) -> Reply {
        let made = (|| -> Result<Reply> {
            let mut memo = self.plan_memo().lock_unpoisoned();
            let own = own.ok_or_else(|| Error::Internal("plan: rank 0 has no table".into()))?;
            memo.tables
                .entry(index::digest(own))
                .or_insert_with(|| Arc::new(own.clone()));
            for &r in asked {
                let bytes = tables
                    .get(r as usize)
                    .map(Vec::as_slice)
                    .unwrap_or_default();
                let d = offers[r as usize].table.clone().unwrap_or_default();
                let t: Table = decode(bytes, "table")?;
                if index::digest(&t) != d {
                    return Err(Error::Internal(format!(
                        "plan: rank {r}'s table does not match its digest"
                    )));
                }
                memo.tables.insert(d, Arc::new(t));
            }
            let digests: Vec<String> = offers
                .iter()
                .map(|o| o.table.clone().unwrap_or_default())
                .collect();
            // Ranks by digest, ascending.
            let mut by: BTreeMap<&str, Vec<u32>> = BTreeMap::new();
            for (r, d) in digests.iter().enumerate() {
                by.entry(d.as_str()).or_default().push(r as u32);
            }
            let groups: Vec<(Arc<Table>, Vec<u32>)> =
                by.into_iter()
                    .map(|(d, ranks)| {
                        let t = memo.tables.get(d).cloned().ok_or_else(|| {
                            Error::Internal(format!("plan: no table of digest {d}"))
                        })?;
                        Ok((t, ranks))
                    })
                    .collect::<Result<_>>()?;
            let refs: Vec<(&Table, &[u32])> = groups
                .iter()
                .map(|(t, r)| (t.as_ref(), r.as_slice()))
                .collect();
            let world = offers.len();
            let p = plan::make(&refs, world)?;
            let index = index::build(&refs, &p.owners, world as u32)?;
            // Only the tables this plan uses are kept.
            memo.tables.retain(|d, _| digests.contains(d));
            memo.plan += 1;
            memo.digests = digests;
            memo.index = Arc::new(index);
            Ok(Reply::Go {
                plan: memo.plan,
                owners: Some(p.owners.into_iter().collect()),
                fence_in_ms,
            })
        })();
        made.unwrap_or_else(|e| Reply::Fail {
            rank: 0,
            error: WireError::from(&e),
            context: String::new(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{DType, Tensor};

    fn t(name: &str, bytes: &[u8]) -> Tensor {
        Tensor::new(name, DType::U8, vec![bytes.len() as u64], bytes.to_vec()).unwrap()
    }

    #[test]
    fn fingerprints_name_the_tensors_that_differ() {
        let a = fingerprint(
            &[t("w", &[1; 64]), t("batch", &[2; 64]), t("y", &[3; 8])],
            0,
            2,
        );
        let b = fingerprint(
            &[t("w", &[1; 64]), t("batch", &[9; 64]), t("y", &[4; 8])],
            1,
            2,
        );
        assert_ne!(a.all, b.all);
        assert_eq!(differing(&a.each, &b.each), ["batch", "y"]);
        let c = fingerprint(
            &[t("y", &[3; 8]), t("w", &[1; 64]), t("batch", &[2; 64])],
            1,
            2,
        );
        assert_eq!(a.all, c.all, "the order of the tensors does not count");
        assert!(differing(&a.each, &c.each).is_empty());
    }
}
