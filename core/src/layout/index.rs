//! What each rank holds, and the root's index of where every tensor's pieces are.
//!
//! A rank describes what it stores as a [`Table`]: per tensor, name, dtype,
//! shape, bytes and [`Placement`]. A piece that is torch.chunk's piece `rank`
//! of `world` along one dimension (how FSDP shards) is described as
//! `Chunk { dim }`, not by its offsets, so every rank of an FSDP job has the
//! same table: rank 0 learns it once, by its digest, whatever the job's size.
//!
//! The root's [`IndexEntry`] list is built from the distinct tables and the
//! plan's owners of replicated items: a whole tensor names the one rank whose
//! fragment has it, a chunked tensor says `split` (piece i in rank i's
//! fragment), and any other pieces are listed with their boxes. Its size is
//! O(tensors) for regular shardings, so a loader finds the fragments that
//! overlap its boxes ([`IndexEntry::ranks_for`]) without reading the others.

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::layout::pymeta;
use crate::model::dtype::DType;
use crate::model::tensor::{numel, Tensor};

/// Where a rank's piece of a tensor sits in it.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Placement {
    /// The whole tensor (unsharded).
    Whole,
    /// A rank's own state (`__rank<r>__<suffix>`, [`pymeta::own_name`]),
    /// named by its suffix alone so that every rank's table says the same.
    Own,
    /// torch.chunk's piece `rank` of `world` along `dim`.
    Chunk {
        /// The split dimension.
        dim: u32,
    },
    /// Any other piece of a sharded tensor.
    Box {
        /// Offsets in the global tensor.
        offsets: Vec<u64>,
        /// Extent.
        shape: Vec<u64>,
    },
}

/// One tensor a rank holds.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Entry {
    /// Tensor name.
    pub name: String,
    /// Element type.
    pub dtype: DType,
    /// The global shape of a sharded tensor; a whole one's shape.
    pub shape: Vec<u64>,
    /// Bytes of this rank's piece (of a chunk: a full chunk's).
    pub bytes: u64,
    /// Where the piece sits.
    pub placement: Placement,
}

/// What one rank holds, sorted.
pub type Table = Vec<Entry>;

/// This rank's table of `tensors`, in a job of `world` ranks.
pub fn table_of(tensors: &[Tensor], rank: usize, world: usize) -> Table {
    let mut t: Table = tensors.iter().map(|t| entry_of(t, rank, world)).collect();
    t.sort();
    t
}

/// What a rank's tensor is in its table.
pub fn entry_of(t: &Tensor, rank: usize, world: usize) -> Entry {
    if t.shard.is_none() && pymeta::own_rank(&t.name) == Some(rank as u64) {
        return Entry {
            name: t.name[pymeta::own_name(rank as u64).len()..].to_owned(),
            dtype: t.dtype,
            shape: t.shape.clone(),
            bytes: t.data.len() as u64,
            placement: Placement::Own,
        };
    }
    let (shape, placement) = match &t.shard {
        None => (t.shape.clone(), Placement::Whole),
        Some(s) => {
            let p = match chunk_dim(&s.offsets, &t.shape, &s.global_shape, rank, world) {
                Some(dim) => Placement::Chunk { dim },
                None => Placement::Box {
                    offsets: s.offsets.clone(),
                    shape: t.shape.clone(),
                },
            };
            (s.global_shape.clone(), p)
        }
    };
    // A chunk counts as a full one (piece 0's bytes), the same on every rank,
    // so that the tables of an FSDP job's ranks are equal; the plan uses
    // bytes only to balance replicated items.
    let bytes = match &placement {
        Placement::Chunk { dim } => {
            let (_, piece) = chunk_box(&shape, *dim as usize, 0, world as u64);
            numel(&piece)
                .and_then(|n| t.dtype.byte_len(n))
                .unwrap_or(t.data.len() as u64)
        }
        _ => t.data.len() as u64,
    };
    Entry {
        name: t.name.clone(),
        dtype: t.dtype,
        shape,
        bytes,
        placement,
    }
}

/// What a checkpointer remembers of its last save's plan, so that a save
/// whose ranks hold what they held then exchanges digests only.
#[derive(Debug, Default)]
pub struct PlanMemo {
    /// The plan's number (0: none yet), the same on every rank.
    pub plan: u64,
    /// Owners of the replicated items.
    pub owners: std::sync::Arc<std::collections::BTreeMap<Item, u32>>,
    /// Rank 0: each rank's table digest at that plan.
    pub digests: Vec<String>,
    /// Rank 0: the distinct tables, by digest.
    pub tables: std::collections::HashMap<String, std::sync::Arc<Table>>,
    /// Rank 0: the index of a checkpoint saved with that plan.
    pub index: std::sync::Arc<Vec<IndexEntry>>,
}

/// A digest of a table, equal on ranks that hold alike.
pub fn digest(table: &Table) -> String {
    let mut h = blake3::Hasher::new();
    match serde_json::to_writer(&mut h, table) {
        Ok(()) => h.finalize().to_hex().to_string(),
        Err(_) => String::new(),
    }
}

/// The box of torch.chunk's piece `rank` of `world` along `dim` of `global`:
/// pieces of ceil(len / world), the last shorter, those past the end empty.
pub fn chunk_box(global: &[u64], dim: usize, rank: u64, world: u64) -> (Vec<u64>, Vec<u64>) {
    let len = global[dim];
    let c = len.div_ceil(world.max(1));
    let start = rank.saturating_mul(c).min(len);
    let end = start.saturating_add(c).min(len);
    let mut offsets = vec![0; global.len()];
    let mut shape = global.to_vec();
    offsets[dim] = start;
    shape[dim] = end - start;
    (offsets, shape)
}

/// The dimension along which a piece is chunk `rank` of `world`, if it is.
fn chunk_dim(
    offsets: &[u64],
    shape: &[u64],
    global: &[u64],
    rank: usize,
    world: usize,
) -> Option<u32> {
    if offsets.len() != global.len() || shape.len() != global.len() || global.is_empty() {
        return None;
    }
    let split: Vec<usize> = (0..global.len())
        .filter(|&d| shape[d] != global[d])
        .collect();
    let dim = match split[..] {
        [d] => d,
        // The whole tensor is chunk 0 of 1.
        [] if world == 1 => 0,
        _ => return None,
    };
    let (o, s) = chunk_box(global, dim, rank as u64, world as u64);
    // An empty piece is at any offset (it covers nothing).
    let same = s == shape && (o == offsets || shape[dim] == 0);
    (same && (0..global.len()).all(|d| d == dim || offsets[d] == 0)).then_some(dim as u32)
}

/// torch.chunk's split of a tensor over every rank of the job.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Split {
    /// The split dimension.
    pub dim: u32,
    /// Pieces (the job's ranks): piece i is in rank i's fragment.
    pub count: u32,
}

/// A piece listed with its box, and the rank whose fragment holds it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Piece {
    /// Whose fragment.
    pub rank: u32,
    /// Offsets in the global tensor.
    pub offsets: Vec<u64>,
    /// Extent.
    pub shape: Vec<u64>,
}

/// One tensor of a root: what it is and which fragments hold its pieces.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct IndexEntry {
    /// Name.
    pub name: String,
    /// Element type.
    pub dtype: DType,
    /// Global shape (a whole tensor's shape).
    pub shape: Vec<u64>,
    /// True for a sharded tensor.
    #[serde(default)]
    pub sharded: bool,
    /// Every rank's own `__rank<r>__<name>`, in rank r's fragment (`name` is
    /// the suffix).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub own: bool,
    /// A whole tensor: the rank whose fragment holds it; `None` for one
    /// several ranks hold (a replica), whose record is in the root itself
    /// ([`in_root`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rank: Option<u32>,
    /// A sharded tensor split as torch.chunk splits it over every rank.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub split: Option<Split>,
    /// Other pieces of a sharded tensor.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub pieces: Vec<Piece>,
}

impl IndexEntry {
    /// Raw bytes of the whole tensor.
    pub fn nbytes(&self) -> Result<u64> {
        self.dtype.byte_len(numel(&self.shape)?)
    }

    /// True for a whole tensor whose record the root holds (see [`in_root`]).
    pub fn in_root(&self) -> bool {
        !self.own && !self.sharded && self.rank.is_none()
    }

    /// Stored pieces (the non-empty ones of a split).
    pub fn piece_count(&self) -> usize {
        let split = self.split.as_ref().map_or(0, |s| {
            let len = self.shape[s.dim as usize];
            let c = len.div_ceil(u64::from(s.count).max(1));
            if c == 0 {
                0
            } else {
                len.div_ceil(c) as usize
            }
        });
        usize::from(self.rank.is_some()) + split + self.pieces.len()
    }

    /// The entry that lists tensor `name` in `index`, and for a rank's own
    /// one that rank (the `own` entries hold the suffix).
    pub fn find<'a>(
        index: &'a std::collections::HashMap<&str, &'a IndexEntry>,
        name: &str,
    ) -> Option<(&'a IndexEntry, Option<u32>)> {
        if let Some(e) = index.get(name).filter(|e| !e.own) {
            return Some((e, None));
        }
        let r = pymeta::own_rank(name)?;
        let suffix = &name[pymeta::own_name(r).len()..];
        let e = index.get(suffix).filter(|e| e.own)?;
        Some((e, Some(u32::try_from(r).ok()?)))
    }

    /// The ranks whose fragments hold pieces that overlap the box at
    /// `offsets` of extent `shape` (a whole tensor: its one rank).
    pub fn ranks_for(&self, offsets: &[u64], shape: &[u64]) -> Vec<u32> {
        let mut out: Vec<u32> = self.rank.into_iter().collect();
        if shape.contains(&0) || offsets.len() != self.shape.len() {
            return out;
        }
        if let Some(s) = &self.split {
            let d = s.dim as usize;
            let c = self.shape[d].div_ceil(u64::from(s.count).max(1)).max(1);
            let (lo, hi) = (offsets[d], offsets[d].saturating_add(shape[d]));
            let last = (hi - 1) / c;
            out.extend(
                (lo / c..=last)
                    .filter(|&i| i < u64::from(s.count))
                    .map(|i| i as u32),
            );
        }
        for p in &self.pieces {
            let overlaps = (0..shape.len()).all(|d| {
                p.offsets[d] < offsets[d].saturating_add(shape[d])
                    && offsets[d] < p.offsets[d].saturating_add(p.shape[d])
            });
            if overlaps {
                out.push(p.rank);
            }
        }
        out.sort_unstable();
        out.dedup();
        out
    }
}

/// Check a root's index: names unique, every piece inside its tensor and
/// in a fragment of the job.
pub(crate) fn validate(index: &[IndexEntry], world: u32) -> std::result::Result<(), String> {
    let mut names = std::collections::HashSet::with_capacity(index.len());
    for e in index {
        let bad = |why: &str| format!("index entry `{}`: {why}", e.name);
        if (e.name.is_empty() && !e.own) || !names.insert((e.name.as_str(), e.own)) {
            return Err(bad("empty or repeated name"));
        }
        e.nbytes().map_err(|x| bad(&x.to_string()))?;
        let whole = e.split.is_none() && e.pieces.is_empty();
        if e.own {
            if e.sharded || e.rank.is_some() || e.split.is_some() || !e.pieces.is_empty() {
                return Err(bad("an own entry names no rank and no pieces"));
            }
            continue;
        }
        if !(e.sharded || whole && e.rank.is_none_or(|r| r < world)) {
            return Err(bad("a whole tensor names one rank of the job, or none"));
        }
        if e.sharded && e.rank.is_some() {
            return Err(bad("a sharded tensor names no single rank"));
        }
        if let Some(s) = &e.split {
            if s.dim as usize >= e.shape.len() || s.count != world {
                return Err(bad("split outside the tensor or the job"));
            }
        }
        for p in &e.pieces {
            let fits = p.rank < world
                && p.offsets.len() == e.shape.len()
                && p.shape.len() == e.shape.len()
                && (0..e.shape.len()).all(|d| {
                    p.offsets[d]
                        .checked_add(p.shape[d])
                        .is_some_and(|x| x <= e.shape[d])
                });
            if !fits {
                return Err(bad("a piece outside the tensor or the job"));
            }
        }
    }
    Ok(())
}

/// An item several ranks may hold: a whole tensor, or a piece at offsets.
pub type Item = (String, Option<Vec<u64>>);

/// Whether the record of `e` goes in the root rather than its writer's
/// fragment: a whole tensor several ranks hold (a replica, with an owner in
/// `owners`). Its one record then costs the root O(1), and a restart reads
/// the root and its own fragment, not the fragment of every replica's writer.
pub fn in_root(owners: &std::collections::BTreeMap<Item, u32>, e: &Entry) -> bool {
    e.placement == Placement::Whole && owners.contains_key(&(e.name.clone(), None))
}

/// The index of a save, from the distinct tables (with the ranks that hold
/// each, ascending, every rank in one) and the writer of each replicated item
/// (items held by one rank are written by it).
pub fn build(
    groups: &[(&Table, &[u32])],
    owners: &std::collections::BTreeMap<Item, u32>,
    world: u32,
) -> Result<Vec<IndexEntry>> {
    use std::collections::BTreeMap;
    struct Acc<'a> {
        entry: IndexEntry,
        chunks: Vec<(u32, &'a [u32])>,
        boxes: BTreeMap<&'a [u64], (&'a [u64], u32)>,
    }
    let mut acc: BTreeMap<&str, Acc<'_>> = BTreeMap::new();
    // Own state: suffix -> each group's entry and ranks.
    let mut own: BTreeMap<&str, Vec<(&Entry, &[u32])>> = BTreeMap::new();
    for (table, ranks) in groups {
        let Some(&first) = ranks.first() else {
            continue;
        };
        for e in table.iter() {
            if e.placement == Placement::Own {
                own.entry(e.name.as_str()).or_default().push((e, ranks));
                continue;
            }
            let sharded = e.placement != Placement::Whole;
            let a = acc.entry(e.name.as_str()).or_insert_with(|| Acc {
                entry: IndexEntry {
                    name: e.name.clone(),
                    dtype: e.dtype,
                    shape: e.shape.clone(),
                    sharded,
                    own: false,
                    rank: None,
                    split: None,
                    pieces: Vec::new(),
                },
                chunks: Vec::new(),
                boxes: BTreeMap::new(),
            });
            if a.entry.dtype != e.dtype || a.entry.shape != e.shape || a.entry.sharded != sharded {
                return Err(Error::InvalidInput(format!(
                    "tensor `{}` is held by ranks with different dtypes, shapes or shardings \
                     (rank {first}: {} {:?}); give rank-local state rank-specific names",
                    e.name, e.dtype, e.shape
                )));
            }
            match &e.placement {
                Placement::Own => {}
                Placement::Whole => {
                    a.entry.rank = (!in_root(owners, e)).then_some(first);
                }
                Placement::Chunk { dim } => a.chunks.push((*dim, ranks)),
                Placement::Box { offsets, shape } => {
                    let key = (e.name.clone(), Some(offsets.clone()));
                    let w = owners.get(&key).copied().unwrap_or(first);
                    a.boxes.insert(offsets, (shape, w));
                }
            }
        }
    }
    let mut out = Vec::with_capacity(acc.len());
    for (_, a) in acc {
        let mut entry = a.entry;
        let held: usize = a.chunks.iter().map(|(_, r)| r.len()).sum();
        let one_dim = a.chunks.windows(2).all(|w| w[0].0 == w[1].0);
        match a.chunks.first() {
            Some(&(dim, _)) if held == world as usize && one_dim => {
                entry.split = Some(Split { dim, count: world });
            }
            _ => {
                for (dim, ranks) in &a.chunks {
                    for &r in ranks.iter() {
                        let (offsets, shape) =
                            chunk_box(&entry.shape, *dim as usize, u64::from(r), u64::from(world));
                        entry.pieces.push(Piece {
                            rank: r,
                            offsets,
                            shape,
                        });
                    }
                }
            }
        }
        for (offsets, (shape, rank)) in a.boxes {
            entry.pieces.push(Piece {
                rank,
                offsets: offsets.to_vec(),
                shape: shape.to_vec(),
            });
        }
        out.push(entry);
    }
    for (suffix, held) in own {
        let entry = |e: &Entry, name: String, rank: Option<u32>, own: bool| IndexEntry {
            name,
            dtype: e.dtype,
            shape: e.shape.clone(),
            sharded: false,
            own,
            rank,
            split: None,
            pieces: Vec::new(),
        };
        let n: usize = held.iter().map(|(_, r)| r.len()).sum();
        let (first, _) = held[0];
        if n == world as usize
            && held
                .iter()
                .all(|(e, _)| e.dtype == first.dtype && e.shape == first.shape)
        {
            // Every rank has one, all alike: one entry for all.
            out.push(entry(first, suffix.to_owned(), None, true));
        } else {
            for (e, ranks) in &held {
                for &r in ranks.iter() {
                    let name = format!("{}{suffix}", pymeta::own_name(u64::from(r)));
                    out.push(entry(e, name, Some(r), false));
                }
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::tensor::ShardSpec;

    fn piece(name: &str, global: &[u64], rank: u64, world: u64) -> Tensor {
        let (offsets, shape) = chunk_box(global, 0, rank, world);
        let n = numel(&shape).unwrap() as usize;
        Tensor::from_f32(name, shape, &vec![1.0; n])
            .unwrap()
            .with_shard(ShardSpec {
                global_shape: global.to_vec(),
                offsets,
            })
            .unwrap()
    }

    #[test]
    fn fsdp_ranks_have_one_table_and_the_index_is_a_split() {
        let world = 5u64;
        // 9 rows over 5 ranks: 2, 2, 2, 2, 1.
        let tables: Vec<Table> = (0..world)
            .map(|r| {
                let ts = vec![
                    piece("w", &[9, 3], r, world),
                    Tensor::from_f32("b", vec![2], &[0.0, 1.0]).unwrap(),
                    // Own state: another name and value on every rank.
                    Tensor::from_f32(format!("__rank{r}__.rng"), vec![1], &[r as f32]).unwrap(),
                ];
                table_of(&ts, r as usize, world as usize)
            })
            .collect();
        assert!(tables.iter().all(|t| digest(t) == digest(&tables[0])));
        let ranks: Vec<u32> = (0..world as u32).collect();
        let owners = [(("b".to_owned(), None), 3u32)].into_iter().collect();
        let index = build(&[(&tables[0], &ranks)], &owners, world as u32).unwrap();
        validate(&index, world as u32).unwrap();
        let w = index.iter().find(|e| e.name == "w").unwrap();
        assert_eq!(w.split, Some(Split { dim: 0, count: 5 }));
        assert_eq!(w.piece_count(), 5);
        // Rows 3..6 are in pieces 1 and 2.
        assert_eq!(w.ranks_for(&[3, 0], &[3, 3]), vec![1, 2]);
        assert_eq!(w.ranks_for(&[8, 0], &[1, 3]), vec![4]);
        let b = index.iter().find(|e| e.name == "b").unwrap();
        // A replica's record is in the root: no fragment holds it.
        assert!(b.in_root() && b.ranks_for(&[0], &[2]).is_empty());
        let by: std::collections::HashMap<&str, &IndexEntry> =
            index.iter().map(|e| (e.name.as_str(), e)).collect();
        let (own, rank) = IndexEntry::find(&by, "__rank4__.rng").unwrap();
        assert!(own.own && rank == Some(4));
        assert!(IndexEntry::find(&by, "__rank4__.other").is_none());
    }

    #[test]
    fn irregular_pieces_are_listed_and_mismatches_refused() {
        // Rank 1 holds rows 1..3 of 4: not chunk 1 of 2.
        let t = Tensor::from_f32("w", vec![2], &[1.0, 2.0])
            .unwrap()
            .with_shard(ShardSpec {
                global_shape: vec![4],
                offsets: vec![1],
            })
            .unwrap();
        let table = table_of(&[t], 1, 2);
        assert!(matches!(table[0].placement, Placement::Box { .. }));
        let chunk0 = table_of(&[piece("w", &[4], 0, 2)], 0, 2);
        let index = build(
            &[(&chunk0, &[0][..]), (&table, &[1][..])],
            &Default::default(),
            2,
        )
        .unwrap();
        assert_eq!(index[0].split, None);
        assert_eq!(index[0].pieces.len(), 2);
        assert_eq!(index[0].ranks_for(&[2], &[1]), vec![1]);
        assert_eq!(index[0].ranks_for(&[0], &[2]), vec![0, 1]);
        let other = table_of(&[Tensor::from_f32("w", vec![4], &[0.0; 4]).unwrap()], 0, 2);
        let e = build(
            &[(&other, &[0][..]), (&table, &[1][..])],
            &Default::default(),
            2,
        );
        assert!(matches!(e, Err(Error::InvalidInput(_))), "{e:?}");
    }
}
