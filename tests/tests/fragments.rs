//! A checkpoint of several ranks as a root and per-rank fragments: what each
//! rank writes and sends, what a load reads, damage, and the old layout.
//!
//! The ranks are tasks of this process over an in-process coordinator (the
//! `Ring` below: a test double for MPI, which the `mpi` tests run for real);
//! everything else is the engine's own code on a local directory.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use ckpt_core::layout::{Manifest, MANIFEST_VERSION, MANIFEST_VERSION_INLINE};
use ckpt_core::{BoxTarget, Checkpointer, Coordinator, DType, Error, ShardSpec, State, Tensor};
use ckpt_tests::*;

/// Per collective round, every rank's contribution, and a wake-up.
type Rounds = (
    Mutex<HashMap<u64, Vec<Option<Vec<u8>>>>>,
    tokio::sync::Notify,
);

/// Ranks of one process.
#[derive(Debug)]
struct Ring {
    rank: usize,
    size: usize,
    round: AtomicU64,
    shared: Arc<Rounds>,
    /// Bytes this rank received from collectives.
    received: AtomicUsize,
}

impl Ring {
    fn new(size: usize) -> Vec<Arc<Ring>> {
        let shared = Arc::new(Default::default());
        (0..size)
            .map(|rank| {
                Arc::new(Ring {
                    rank,
                    size,
                    round: AtomicU64::new(0),
                    shared: Arc::clone(&shared),
                    received: AtomicUsize::new(0),
                })
            })
            .collect()
    }

    async fn exchange(&self, data: Vec<u8>) -> ckpt_core::Result<Vec<Vec<u8>>> {
        let round = self.round.fetch_add(1, Ordering::SeqCst);
        let (slots, notify) = &*self.shared;
        slots
            .lock()
            .unwrap()
            .entry(round)
            .or_insert_with(|| vec![None; self.size])[self.rank] = Some(data);
        notify.notify_waiters();
        let wait = async {
            loop {
                let woken = notify.notified();
                tokio::pin!(woken);
                woken.as_mut().enable();
                if let Some(all) = slots.lock().unwrap().get(&round) {
                    if all.iter().all(Option::is_some) {
                        return all.iter().flatten().cloned().collect::<Vec<_>>();
                    }
                }
                woken.await;
            }
        };
        tokio::time::timeout(Duration::from_secs(20), wait)
            .await
            .map_err(|_| Error::Timeout(format!("rank {} in round {round}", self.rank)))
    }
}

#[async_trait]
impl Coordinator for Ring {
    fn rank(&self) -> usize {
        self.rank
    }
    fn world_size(&self) -> usize {
        self.size
    }
    async fn all_gather(&self, data: Vec<u8>, _: Duration) -> ckpt_core::Result<Vec<Vec<u8>>> {
        let all = self.exchange(data).await?;
        self.received
            .fetch_add(all.iter().map(Vec::len).sum(), Ordering::SeqCst);
        Ok(all)
    }
    async fn broadcast(
        &self,
        data: Vec<u8>,
        root: usize,
        _: Duration,
    ) -> ckpt_core::Result<Vec<u8>> {
        let mut all = self.exchange(data).await?;
        self.received.fetch_add(all[root].len(), Ordering::SeqCst);
        Ok(all.swap_remove(root))
    }
    async fn gather(
        &self,
        data: Vec<u8>,
        root: usize,
        _: Duration,
    ) -> ckpt_core::Result<Vec<Vec<u8>>> {
        let mut all = self.exchange(data).await?;
        if self.rank != root {
            all.clear();
        }
        self.received
            .fetch_add(all.iter().map(Vec::len).sum(), Ordering::SeqCst);
        Ok(all)
    }
}

const ROWS: u64 = 10;
const COLS: u64 = 3;

/// The value of element `i` of tensor `name` at `step`.
fn global(step: u64, name: &str, n: u64) -> Vec<u8> {
    bytes_for(step * 1000 + name.len() as u64, (n * 4) as usize)
}

/// Rank `r` of `n`'s state: torch.chunk's row piece of `w` and `m` (FSDP),
/// a replicated `b`, and its own `__rank<r>__.rng` (as the Python layer names it).
fn state(step: u64, r: u64, n: u64) -> State {
    let mut s = State::new();
    for name in ["w", "m"] {
        let all = global(step, name, ROWS * COLS);
        let c = ROWS.div_ceil(n);
        let (lo, hi) = ((r * c).min(ROWS), ((r + 1) * c).min(ROWS));
        let piece =
            Bytes::copy_from_slice(&all[(lo * COLS * 4) as usize..(hi * COLS * 4) as usize]);
        let t = Tensor::new(name, DType::F32, vec![hi - lo, COLS], piece)
            .unwrap()
            .with_shard(ShardSpec {
                global_shape: vec![ROWS, COLS],
                offsets: vec![lo, 0],
            })
            .unwrap();
        s = s.with_tensor(t);
    }
    s.with_tensor(Tensor::new("b", DType::F32, vec![5], Bytes::from(global(step, "b", 5))).unwrap())
        .with_tensor(tensor(&format!("__rank{r}__.rng"), DType::U8, &[8], r))
}

async fn open(url: &str, ring: &[Arc<Ring>]) -> Vec<Checkpointer> {
    let mut out = Vec::new();
    let opens = ring.iter().map(|g| {
        let url = url.to_owned();
        let g = Arc::clone(g);
        tokio::spawn(async move {
            ckpt_formats::builder(&url)
                .coordinator(g)
                .build()
                .await
                .unwrap()
        })
    });
    for o in futures::future::join_all(opens).await {
        out.push(o.unwrap());
    }
    out
}

async fn save_all(cps: &[Checkpointer], step: u64) {
    let n = cps.len() as u64;
    let saves = cps.iter().enumerate().map(|(r, cp)| {
        let cp = cp.clone();
        tokio::spawn(async move { cp.save(step, &state(step, r as u64, n)).await?.wait().await })
    });
    for s in futures::future::join_all(saves).await {
        s.unwrap().unwrap();
    }
}

/// Rows `lo..hi` of `name` at `step`, from `cp`'s checkpoint `id`.
async fn rows(cp: &Checkpointer, name: &str, lo: u64, hi: u64) -> ckpt_core::Result<Vec<u8>> {
    let id = cp.committed().await?.pop().unwrap();
    let mut buf = vec![0u8; ((hi - lo) * COLS * 4) as usize];
    cp.load_boxes_into(
        &id,
        vec![BoxTarget {
            name,
            dtype: Some(DType::F32),
            shape: vec![hi - lo, COLS],
            spec: ShardSpec {
                global_shape: vec![ROWS, COLS],
                offsets: vec![lo, 0],
            },
            dst: &mut buf,
        }],
    )
    .await?;
    Ok(buf)
}

fn expect(step: u64, name: &str, lo: u64, hi: u64) -> Vec<u8> {
    global(step, name, ROWS * COLS)[(lo * COLS * 4) as usize..(hi * COLS * 4) as usize].to_vec()
}

fn fragment_path(dir: &std::path::Path, m: &Manifest, rank: u32) -> std::path::PathBuf {
    dir.join(ckpt_core::layout::fragment::fragment_key(&m.id(), rank).as_ref())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_root_lists_fragments_and_a_load_reads_only_those_it_needs() {
    let (dir, url) = temp_root();
    let ring = Ring::new(4);
    let cps = open(&url, &ring).await;
    save_all(&cps, 1).await;
    let first: Vec<usize> = ring
        .iter()
        .map(|g| g.received.swap(0, Ordering::SeqCst))
        .collect();
    save_all(&cps, 2).await;
    let later: Vec<usize> = ring
        .iter()
        .map(|g| g.received.swap(0, Ordering::SeqCst))
        .collect();
    // A repeated save sends every rank but rank 0 a fixed few hundred bytes.
    for r in 1..4 {
        assert!(
            later[r] <= first[r] && later[r] < 600,
            "rank {r}: {first:?} then {later:?}"
        );
    }

    let id = cps[0].committed().await.unwrap().pop().unwrap();
    let root = cps[0].root(&id).await.unwrap();
    assert_eq!(root.version, MANIFEST_VERSION);
    assert_eq!(root.fragments.len(), 4);
    let w = root.index.iter().find(|e| e.name == "w").unwrap();
    assert!(w.split.is_some() && w.pieces.is_empty(), "{w:?}");
    // The replicated `b` is recorded in the root itself, whoever wrote it.
    let b = root.index.iter().find(|e| e.name == "b").unwrap();
    assert!(b.in_root() && b.rank.is_none(), "{b:?}");
    let names: Vec<&str> = root.tensors.iter().map(|t| t.name.as_str()).collect();
    assert_eq!(names, ["b"]);

    // Rank 2's own rows (3..6 of 10 over 4: torch.chunk gives 3, 3, 3, 1)
    // and `b` need fragment 2 alone: remove the others.
    for r in (0..4).filter(|&r| r != 2) {
        std::fs::remove_file(fragment_path(dir.path(), &root, r)).unwrap();
    }
    let reader = ckpt_formats::builder(&url)
        .read_only()
        .build()
        .await
        .unwrap();
    assert_eq!(
        rows(&reader, "w", 6, 9).await.unwrap(),
        expect(2, "w", 6, 9)
    );
    let got = reader
        .load_tensors(&id, &["b", "__rank2__.rng"])
        .await
        .unwrap();
    assert_eq!(got[0].data, Bytes::from(global(2, "b", 5)));
    // What lives in a removed fragment is damage, never a partial load.
    let e = rows(&reader, "w", 0, 10).await.unwrap_err();
    assert!(e.is_damage(), "{e}");
    // load_latest passes over the damaged step to the intact one.
    let latest = reader.load_latest().await.unwrap().unwrap();
    assert_eq!(latest.id.step, 1);
    assert_eq!(latest.skipped.len(), 1);
    let whole = latest.state.tensor("w").unwrap();
    assert_eq!(whole.data[..], expect(1, "w", 0, ROWS)[..]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fragment_that_fails_its_hash_damages_its_checkpoint() {
    let (dir, url) = temp_root();
    let cps = open(&url, &Ring::new(2)).await;
    save_all(&cps, 1).await;
    save_all(&cps, 2).await;
    let id = cps[0].committed().await.unwrap().pop().unwrap();
    let root = cps[0].root(&id).await.unwrap();
    let path = fragment_path(dir.path(), &root, 1);
    let mut bytes = std::fs::read(&path).unwrap();
    let at = bytes.len() - 5;
    bytes[at] ^= 1;
    std::fs::write(&path, bytes).unwrap();
    let reader = ckpt_formats::builder(&url)
        .read_only()
        .build()
        .await
        .unwrap();
    let latest = reader.load_latest().await.unwrap().unwrap();
    assert_eq!(latest.id.step, 1);
    let e = &latest.skipped[0].1;
    assert!(e.is_damage() && e.to_string().contains("hash"), "{e}");
}

/// A checkpoint of several ranks stored before fragments (one manifest with
/// every rank's records) loads as it did, whole and resharded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_single_manifest_layout_still_loads() {
    let (dir, url) = temp_root();
    let cps = open(&url, &Ring::new(4)).await;
    save_all(&cps, 3).await;
    let id = cps[0].committed().await.unwrap().pop().unwrap();
    let mut old = cps[0].manifest(&id).await.unwrap();
    assert_eq!(old.tensors.len(), 4 * 2 + 1 + 4, "{:?}", old.tensors);
    for f in &old.fragments {
        std::fs::remove_file(fragment_path(dir.path(), &old, f.rank)).unwrap();
    }
    old.version = MANIFEST_VERSION_INLINE;
    old.fragments.clear();
    old.index.clear();
    old.objects.retain(|o| !o.contains("/records/"));
    let key = ckpt_core::layout::manifest_key(&id);
    std::fs::write(dir.path().join(key.as_ref()), old.encode().unwrap()).unwrap();

    let two = open(&url, &Ring::new(2)).await;
    assert_eq!(
        rows(&two[1], "m", 5, 10).await.unwrap(),
        expect(3, "m", 5, 10)
    );
    let latest = two[0].load_latest().await.unwrap().unwrap();
    assert_eq!(latest.id, id);
    assert_eq!(latest.manifest.version, MANIFEST_VERSION_INLINE);
    assert_eq!(
        latest.state.tensor("w").unwrap().data[..],
        expect(3, "w", 0, ROWS)[..]
    );
}

/// A root of the first fragment layout (version 2: a replica's record in
/// its writer's fragment, named by the index) loads as it did.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_first_fragment_layout_still_loads() {
    use ckpt_core::layout::{Fragment, MANIFEST_VERSION_FRAGMENTS};
    let (dir, url) = temp_root();
    let cps = open(&url, &Ring::new(4)).await;
    save_all(&cps, 3).await;
    let id = cps[0].committed().await.unwrap().pop().unwrap();
    let mut root = cps[0].root(&id).await.unwrap();
    // `b` goes back into rank 3's fragment, as version 2 kept it.
    let path = fragment_path(dir.path(), &root, 3);
    let mut frag = Fragment::decode(&std::fs::read(&path).unwrap(), "fragment").unwrap();
    frag.tensors.append(&mut root.tensors);
    let bytes = frag.encode().unwrap();
    std::fs::write(&path, &bytes).unwrap();
    let r3 = root.fragments.iter_mut().find(|f| f.rank == 3).unwrap();
    r3.blake3 = blake3::hash(&bytes).to_hex().to_string();
    r3.len = bytes.len() as u64;
    root.index.iter_mut().find(|e| e.name == "b").unwrap().rank = Some(3);
    root.version = MANIFEST_VERSION_FRAGMENTS;
    let key = ckpt_core::layout::manifest_key(&id);
    std::fs::write(dir.path().join(key.as_ref()), root.encode().unwrap()).unwrap();

    let two = open(&url, &Ring::new(2)).await;
    let got = two[1].load_tensors(&id, &["b"]).await.unwrap();
    assert_eq!(got[0].data, Bytes::from(global(3, "b", 5)));
    let latest = two[0].load_latest().await.unwrap().unwrap();
    assert_eq!(
        (latest.id, latest.manifest.version),
        (id, MANIFEST_VERSION_FRAGMENTS)
    );
    assert_eq!(
        latest.state.tensor("w").unwrap().data[..],
        expect(3, "w", 0, ROWS)[..]
    );
}

/// Per-rank values saved under one name (each rank's prefetched batch) would
/// be stored once, as if replicated: the save fails on every rank instead,
/// and says what to do.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn per_rank_values_under_one_name_are_refused_on_every_rank() {
    let (_dir, url) = temp_root();
    let cps = open(&url, &Ring::new(2)).await;
    let saves = cps.iter().enumerate().map(|(r, cp)| {
        let cp = cp.clone();
        let st =
            state(1, r as u64, 2).with_tensor(tensor("batch.x", DType::I64, &[16], 50 + r as u64));
        tokio::spawn(async move { cp.save(1, &st).await?.wait().await })
    });
    for s in futures::future::join_all(saves).await {
        match s.unwrap() {
            Err(Error::InvalidInput(why)) => {
                assert!(
                    why.contains("differ") && why.contains("differs per rank"),
                    "{why}"
                )
            }
            other => panic!("expected InvalidInput, got {other:?}"),
        }
    }
    // The same value on both ranks is a replica, as before.
    let saves = cps.iter().enumerate().map(|(r, cp)| {
        let cp = cp.clone();
        let st = state(2, r as u64, 2).with_tensor(tensor("batch.x", DType::I64, &[16], 50));
        tokio::spawn(async move { cp.save(2, &st).await?.wait().await })
    });
    for s in futures::future::join_all(saves).await {
        s.unwrap().unwrap();
    }
}
