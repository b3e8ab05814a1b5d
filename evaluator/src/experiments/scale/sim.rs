//! The simulated scale run: N ranks as tasks of this process, each with a real
//! [`Checkpointer`] (native format, `keep_last`), an [`InProcessGroup`] rank
//! counted by a [`CountingCoordinator`], and its own counted view
//! ([`RankStore`]) of one in-memory store. Per rank count: three saves, the
//! root's metadata bytes, a load by as many ranks and by half as many (every
//! loaded byte checked), what a commit's GC asks of the store, and what
//! opening a checkpointer on the root does.

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use ckpt_core::store::Capabilities;
use ckpt_core::testing::{CollectiveCounts, CountingCoordinator, InProcessGroup};
use ckpt_core::{CheckpointId, Checkpointer, CheckpointerOptions, Retention};
use futures::TryStreamExt;
use object_store::path::Path;
use object_store::ObjectStore;
use serde::Serialize;

use super::state::{self, Shape};
use super::store::{RankStore, Requests, Split};
use crate::experiments::Error;

/// Settings of one simulated rank count.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct SimShape {
    /// The state of every rank.
    pub state: Shape,
    /// Checkpoints kept.
    pub keep_last: usize,
}

/// What the ranks of one save came to.
#[derive(Debug, Clone, Serialize)]
pub struct SaveFigures {
    /// 1 for the first save.
    pub save: usize,
    /// Collective bytes a rank sent, the most of any rank.
    pub sent_max: u64,
    /// Collective bytes a rank received, the most of any rank.
    pub received_max: u64,
    /// Collective bytes a rank other than rank 0 sent and received, the
    /// most of any (rank 0 receives what the commit gathers: O(ranks)).
    pub others_max: u64,
    /// Rank 0's collectives, by kind.
    pub rank0: CollectiveCounts,
    /// Collective bytes received by every rank together.
    pub received_all: u64,
    /// Store requests of every rank together.
    pub requests: Requests,
    /// Store requests of one rank, the most of any rank (field by field).
    pub requests_rank_max: Requests,
    /// Rank 0's requests after it put the manifest (fence check, retention, GC).
    pub after_manifest: Option<Requests>,
    /// The slowest rank's `wait`, s.
    pub commit_s: f64,
    /// From the first `save` call to the last `wait` returning, s.
    pub wall_s: f64,
}

/// What one load by every rank of a job came to.
#[derive(Debug, Clone, Serialize)]
pub struct LoadFigures {
    /// Loading ranks.
    pub ranks: usize,
    /// Requests of opening a read-only checkpointer, the most of any rank.
    pub open_rank_max: Requests,
    /// Requests of the load (listing the checkpoints, then the boxes), the
    /// most of any rank.
    pub rank_max: Requests,
    /// The same, the mean over ranks (each field).
    pub rank_mean: [f64; 4],
    /// Metadata bytes a loading rank read (gets of keys outside the data
    /// chunks), the most of any rank.
    pub meta_bytes_max: u64,
    /// The same, the mean over ranks.
    pub meta_bytes_mean: f64,
    /// Tensor bytes loaded and checked, all ranks together.
    pub checked_bytes: u64,
    /// From the first rank's listing to the last rank's bytes, s.
    pub wall_s: f64,
}

/// One rank count that ran.
#[derive(Debug, Clone, Serialize)]
pub struct RankRun {
    /// Ranks.
    pub ranks: usize,
    /// Bytes of one rank's state.
    pub rank_bytes: u64,
    /// Seconds to open the ranks' checkpointers.
    pub open_s: f64,
    /// The saves, in order.
    pub saves: Vec<SaveFigures>,
    /// Bytes of the newest checkpoint's objects under `manifests/`.
    pub root_bytes: u64,
    /// Bytes of the newest checkpoint's largest fragment of records.
    pub fragment_max_bytes: u64,
    /// The load by as many ranks as saved.
    pub load_same: LoadFigures,
    /// The load by half as many (each box two old pieces), from 2 ranks on.
    pub load_half: Option<LoadFigures>,
}

impl RankRun {
    /// The most collective bytes every rank together received in one save.
    pub fn received_all(&self) -> u64 {
        self.saves.iter().map(|s| s.received_all).max().unwrap_or(0)
    }
}

/// Options every simulated checkpointer gets.
pub fn options(keep_last: usize, read_only: bool) -> CheckpointerOptions {
    CheckpointerOptions {
        retention: Retention::keep_last(keep_last),
        // A rank that failed leaves the others waiting this long.
        collective_timeout: Duration::from_secs(300),
        // Nothing else writes under the root: GC may delete at once.
        gc_grace: Duration::ZERO,
        snapshot_threads: 1,
        read_only,
        ..CheckpointerOptions::default()
    }
}

/// Run `f(rank)` for every rank as a task; their results in rank order.
async fn on_ranks<T, F, Fut>(n: usize, f: F) -> Result<Vec<T>, Error>
where
    F: Fn(usize) -> Fut,
    Fut: Future<Output = Result<T, ckpt_core::Error>> + Send + 'static,
    T: Send + 'static,
{
    on_ranks_in_waves(n, n, f).await
}

/// Loading ranks in flight at once. A load takes part in no collective, so
/// ranks may run in waves: each still reads and parses the root itself, but
/// the process does not hold 16,384 parsed roots at once (a real job holds
/// one per host process).
const LOAD_WAVE: usize = 512;

/// [`on_ranks`], at most `wave` ranks at a time (ranks that meet in
/// collectives must all be in one wave).
async fn on_ranks_in_waves<T, F, Fut>(n: usize, wave: usize, f: F) -> Result<Vec<T>, Error>
where
    F: Fn(usize) -> Fut,
    Fut: Future<Output = Result<T, ckpt_core::Error>> + Send + 'static,
    T: Send + 'static,
{
    let mut out = Vec::with_capacity(n);
    for start in (0..n).step_by(wave.max(1)) {
        let end = (start + wave.max(1)).min(n);
        let tasks: Vec<_> = (start..end).map(|r| tokio::spawn(f(r))).collect();
        for (t, r) in tasks.into_iter().zip(start..) {
            let v = t
                .await
                .map_err(|e| format!("rank {r}: {e}"))?
                .map_err(|e| format!("rank {r} of {n}: {e}"))?;
            out.push(v);
        }
    }
    Ok(out)
}

/// The ranks of one job on the shared store.
pub struct Job {
    cps: Vec<Checkpointer>,
    stores: Vec<Arc<RankStore>>,
    coords: Vec<Arc<CountingCoordinator>>,
}

impl Job {
    /// Open `n` ranks' checkpointers on `inner`.
    pub async fn open(
        inner: &Arc<dyn ObjectStore>,
        url: &str,
        n: usize,
        opts: CheckpointerOptions,
    ) -> Result<Job, Error> {
        let stores: Vec<Arc<RankStore>> = (0..n)
            .map(|_| Arc::new(RankStore::new(inner.clone())))
            .collect();
        let coords: Vec<Arc<CountingCoordinator>> = InProcessGroup::new(n)
            .into_iter()
            .map(|g| Arc::new(CountingCoordinator::new(g)))
            .collect();
        let cps = on_ranks(n, |r| {
            let b = ckpt_formats::builder(url)
                .store(stores[r].clone())
                .capabilities(Capabilities::of_url(url))
                .coordinator(coords[r].clone())
                .options(opts.clone());
            async move { b.build().await }
        })
        .await?;
        Ok(Job {
            cps,
            stores,
            coords,
        })
    }

    fn counts(&self) -> Vec<Split> {
        self.stores.iter().map(|s| s.counts()).collect()
    }

    fn reset(&self) {
        for c in &self.coords {
            c.reset();
        }
    }
}

/// Per-rank requests between two snapshots.
fn diff(after: &[Split], before: &[Split]) -> Vec<Split> {
    after.iter().zip(before).map(|(a, b)| *a - *b).collect()
}

fn sum(v: &[Requests]) -> Requests {
    v.iter().fold(Requests::default(), |a, r| a.add(r))
}

fn max(v: &[Requests]) -> Requests {
    v.iter().fold(Requests::default(), |a, r| a.max(r))
}

/// Save step `step` with data of `seed` on every rank; what it took.
pub async fn save(
    job: &Job,
    shape: Shape,
    save: usize,
    seed: u64,
) -> Result<(SaveFigures, CheckpointId), Error> {
    let n = job.cps.len();
    job.reset();
    let _ = job.stores[0].take_published();
    let before = job.counts();
    let t = Instant::now();
    let waits = on_ranks(n, |r| {
        let cp = job.cps[r].clone();
        async move {
            let st = state::of_rank(shape, r, n, seed)?;
            let h = cp.save(save as u64, st).await?;
            let w = Instant::now();
            let report = h.wait().await?;
            Ok((w.elapsed(), report.id))
        }
    })
    .await?;
    let wall_s = t.elapsed().as_secs_f64();
    let per_rank = diff(&job.counts(), &before);
    let reqs: Vec<Requests> = per_rank.iter().map(Split::all).collect();
    let coll: Vec<CollectiveCounts> = job.coords.iter().map(|c| c.snapshot()).collect();
    let after_manifest = job.stores[0]
        .take_published()
        .map(|at| (job.stores[0].counts() - at).all());
    let id = waits[0].1.clone();
    let figures = SaveFigures {
        save,
        sent_max: coll.iter().map(|c| c.sent_bytes()).max().unwrap_or(0),
        received_max: coll.iter().map(|c| c.received_bytes()).max().unwrap_or(0),
        others_max: coll
            .iter()
            .skip(1)
            .map(|c| c.sent_bytes() + c.received_bytes())
            .max()
            .unwrap_or(0),
        rank0: coll[0],
        received_all: coll.iter().map(|c| c.received_bytes()).sum(),
        requests: sum(&reqs),
        requests_rank_max: max(&reqs),
        after_manifest,
        commit_s: waits.iter().map(|w| w.0.as_secs_f64()).fold(0.0, f64::max),
        wall_s,
    };
    Ok((figures, id))
}

/// Bytes of the objects under `manifests/` of checkpoint `id` (the root
/// manifest, and whatever else a commit keeps there), and of its largest
/// fragment of records (under `data/<id>/records/`).
pub async fn root_bytes(store: &dyn ObjectStore, id: &CheckpointId) -> Result<(u64, u64), Error> {
    let name = format!("{:020}-{}", id.step, id.attempt);
    let listed = |prefix: Path| async move {
        store
            .list(Some(&prefix))
            .try_collect::<Vec<_>>()
            .await
            .map_err(ckpt_core::Error::from)
    };
    let root = listed(Path::from(ckpt_core::layout::MANIFESTS))
        .await?
        .iter()
        .filter(|o| o.location.as_ref().contains(&name))
        .map(|o| o.size)
        .sum();
    let fragment = listed(ckpt_core::layout::data_prefix(id).clone().join("records"))
        .await?
        .iter()
        .map(|o| o.size)
        .max()
        .unwrap_or(0);
    Ok((root, fragment))
}

/// Open `loaders` read-only ranks on the root and load, on each, its box of
/// the newest checkpoint (saved by `saved` ranks with `seed`), checking
/// every byte.
pub async fn load(
    inner: &Arc<dyn ObjectStore>,
    url: &str,
    sim: SimShape,
    loaders: usize,
    saved: usize,
    seed: u64,
) -> Result<LoadFigures, Error> {
    let start = Job::counts_of(inner, url, loaders, sim).await?;
    let (job, opened) = start;
    let before = job.counts();
    let t = Instant::now();
    let checked = on_ranks_in_waves(loaders, LOAD_WAVE, |q| {
        let cp = job.cps[q].clone();
        async move {
            let ids = cp.committed().await?;
            let id = ids.last().ok_or_else(|| ckpt_core::Error::NotFound {
                what: "a committed checkpoint".into(),
            })?;
            let wants = state::wants(sim.state, q, loaders, saved, seed);
            let wanted: Vec<(&str, Vec<u64>, ckpt_core::ShardSpec)> = wants
                .iter()
                .map(|w| (w.name.as_str(), w.shape.clone(), w.spec.clone()))
                .collect();
            let got = cp.load_shards(id, &wanted).await?;
            let mut n = 0;
            for (w, t) in wants.iter().zip(&got) {
                if t.data != w.expect || t.dtype != w.dtype {
                    return Err(ckpt_core::Error::Internal(format!(
                        "rank {q} of {loaders}: `{}` at {:?} is not what was saved",
                        w.name, w.spec.offsets
                    )));
                }
                n += t.data.len() as u64;
            }
            Ok(n)
        }
    })
    .await?;
    let wall_s = t.elapsed().as_secs_f64();
    let per_rank = diff(&job.counts(), &before);
    let reqs: Vec<Requests> = per_rank.iter().map(Split::all).collect();
    let meta: Vec<u64> = per_rank.iter().map(|s| s.meta().get_bytes).collect();
    let mean = |f: fn(&Requests) -> u64| -> f64 {
        reqs.iter().map(|r| f(r) as f64).sum::<f64>() / loaders.max(1) as f64
    };
    Ok(LoadFigures {
        ranks: loaders,
        open_rank_max: max(&opened),
        rank_max: max(&reqs),
        rank_mean: [
            mean(|r| r.get),
            mean(|r| r.list),
            mean(|r| r.head),
            mean(|r| r.get_bytes),
        ],
        meta_bytes_max: meta.iter().copied().max().unwrap_or(0),
        meta_bytes_mean: meta.iter().sum::<u64>() as f64 / loaders.max(1) as f64,
        checked_bytes: checked.iter().sum(),
        wall_s,
    })
}

impl Job {
    /// Open `n` read-only ranks; the job and each rank's requests to open.
    async fn counts_of(
        inner: &Arc<dyn ObjectStore>,
        url: &str,
        n: usize,
        sim: SimShape,
    ) -> Result<(Job, Vec<Requests>), Error> {
        let job = Job::open(inner, url, n, options(sim.keep_last, true)).await?;
        let opened = job.counts().iter().map(Split::all).collect();
        Ok((job, opened))
    }
}

/// A unique `memory://` URL and a fresh store for it.
pub fn fresh_root(what: &str) -> (String, Arc<dyn ObjectStore>) {
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(0);
    let url = format!(
        "memory://scale-sim-{what}-{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    );
    (url, Arc::new(object_store::memory::InMemory::new()))
}

/// Everything measured at one rank count: three saves (the second and third
/// with the same tensors, other bytes), the root's bytes, and the two loads.
pub async fn run_ranks(n: usize, sim: SimShape) -> Result<RankRun, Error> {
    let (url, inner) = fresh_root(&n.to_string());
    let t = Instant::now();
    let job = Job::open(&inner, &url, n, options(sim.keep_last, false)).await?;
    let open_s = t.elapsed().as_secs_f64();
    let mut saves = Vec::new();
    let mut last = None;
    for k in 1..=3 {
        let (f, id) = save(&job, sim.state, k, k as u64).await?;
        saves.push(f);
        last = Some(id);
    }
    drop(job);
    let id = last.ok_or("no save")?;
    let (root_bytes, fragment_max_bytes) = root_bytes(inner.as_ref(), &id).await?;
    let load_same = load(&inner, &url, sim, n, n, 3).await?;
    let load_half = if n >= 2 && n % 2 == 0 {
        Some(load(&inner, &url, sim, n / 2, n, 3).await?)
    } else {
        None
    };
    Ok(RankRun {
        ranks: n,
        rank_bytes: state::rank_bytes(sim.state),
        open_s,
        saves,
        root_bytes,
        fragment_max_bytes,
        load_same,
        load_half,
    })
}
