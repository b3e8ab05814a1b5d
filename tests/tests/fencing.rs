//! Writer epochs: an old incarnation of a job that is still running (a zombie)
//! can neither commit a checkpoint that the new incarnation would load nor
//! delete anything the new one keeps. Two incarnations race on one root, on
//! local disk, in memory and (with `scripts/test.sh`) on S3 against Garage,
//! which ignores conditional puts (the best-effort claim).

use std::collections::HashSet;
use std::time::Duration;

use ckpt_core::failpoint;
use ckpt_core::layout::{self, epoch};
use ckpt_core::store::{self, Capabilities};
use ckpt_core::{Checkpointer, CheckpointerOptions, Error, Result, Retention};
use ckpt_tests::*;
use object_store::path::Path;
use object_store::{ObjectStoreExt, PutPayload};

/// Failpoints are process-wide: the tests that arm one run alone.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

fn opts(keep_last: usize) -> CheckpointerOptions {
    let mut o = CheckpointerOptions::default();
    o.write.chunk_size = 4096;
    o.retention = Retention::keep_last(keep_last);
    o.fence_lease = Duration::from_millis(200);
    o.gc_grace = Duration::ZERO;
    o
}

async fn open(url: &str, o: CheckpointerOptions) -> Result<Checkpointer> {
    ckpt_formats::builder(url).options(o).build().await
}

/// Every chunk that a valid checkpoint's manifest references is stored.
async fn no_chunk_missing(cp: &Checkpointer) -> Result<()> {
    let store = cp.store().as_ref();
    for id in cp.committed().await? {
        let m = layout::read_manifest(store, &id).await?;
        for h in m.chunk_hashes() {
            assert!(
                store.head(&layout::chunk_key(h)).await.is_ok(),
                "chunk {h} of kept checkpoint {id} is gone"
            );
        }
    }
    Ok(())
}

/// The scenario of the issue: A saves 1 and 2 and hangs; B resumes from 2 and
/// saves 3 and 4; A wakes and saves 100 and collects. A is refused, B's work
/// stays, and a fresh restart loads B's step 4.
async fn zombie_after_restart(url: &str) -> Result<()> {
    let a = open(url, opts(1)).await?;
    for step in 1..=2 {
        a.save(step, &f32_state(4, 3000, step))
            .await?
            .wait()
            .await?;
    }
    let b = open(url, opts(1)).await?;
    let resumed = b.load_latest().await?.expect("A's step 2");
    assert_eq!(resumed.id.step, 2);
    for step in 3..=4 {
        b.save(step, &f32_state(4, 3000, 10 + step))
            .await?
            .wait()
            .await?;
    }
    // The zombie's save is refused at commit, and nothing of it is published.
    let err = a
        .save(100, &f32_state(4, 3000, 100))
        .await?
        .wait()
        .await
        .unwrap_err();
    match err {
        Error::Fenced { epoch, current } => assert!(epoch < current, "{epoch} {current}"),
        e => panic!("expected Fenced, got {e:?}"),
    }
    assert!(matches!(a.gc().await, Err(Error::Fenced { .. })));
    let raw = layout::committed(b.store().as_ref()).await?;
    assert!(raw.iter().all(|id| id.step != 100), "{raw:?}");
    assert_eq!(committed_steps(&b).await?, vec![4]);
    no_chunk_missing(&b).await?;
    // A fresh restart gets B's state, bitwise.
    let c = open(url, opts(1)).await?;
    let loaded = c.load_latest().await?.expect("B's step 4");
    assert_eq!(loaded.id.step, 4);
    assert_same(&loaded.state, &f32_state(4, 3000, 14));
    assert_eq!(loaded.manifest.epoch, 2);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_zombie_on_local_disk_neither_commits_nor_collects() -> Result<()> {
    let _g = SERIAL.lock().await;
    let (_dir, url) = temp_root();
    zombie_after_restart(&url).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_zombie_in_memory_neither_commits_nor_collects() -> Result<()> {
    let _g = SERIAL.lock().await;
    zombie_after_restart(&memory_root("zombie")).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_zombie_on_s3_neither_commits_nor_collects() -> Result<()> {
    let _g = SERIAL.lock().await;
    let Some(url) = s3_url("zombie") else {
        return Ok(());
    };
    // Garage ignores If-None-Match: the claim is read back (best effort).
    assert!(!Capabilities::of_url(&url).atomic_create);
    zombie_after_restart(&url).await
}

/// The race inside a commit: the zombie checked its epoch, then the new
/// incarnation claimed, then the zombie published. Its manifest is stored but
/// counts for nobody, the zombie is told, and the new incarnation may save the
/// same step and collects the zombie's manifest.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_manifest_published_after_the_claim_is_passed_over() -> Result<()> {
    let _g = SERIAL.lock().await;
    let (_dir, url) = temp_root();
    let a = open(&url, opts(2)).await?;
    a.save(1, &f32_state(3, 3000, 1)).await?.wait().await?;
    failpoint::set("save.before_manifest", "sleep(800)");
    let late = a.save(2, &f32_state(3, 3000, 2)).await?;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let b = open(&url, opts(2)).await?;
    let resumed = b.load_latest().await?.expect("step 1");
    failpoint::clear_all();
    assert_eq!(resumed.id.step, 1);
    assert!(matches!(late.wait().await, Err(Error::Fenced { .. })));
    // Stored, but not a checkpoint of the job.
    let raw = layout::committed(b.store().as_ref()).await?;
    assert!(raw.iter().any(|id| id.step == 2), "{raw:?}");
    assert_eq!(committed_steps(&b).await?, vec![1]);
    let again = b.load_latest().await?.expect("step 1");
    assert_eq!(again.id.step, 1);
    // B saves step 2 itself: the zombie's step 2 is no conflict, and B's GC
    // removes the zombie's manifest whatever the retention.
    b.save(2, &f32_state(3, 3000, 22)).await?.wait().await?;
    b.save(3, &f32_state(3, 3000, 23)).await?.wait().await?;
    let raw: Vec<_> = layout::committed(b.store().as_ref()).await?;
    let by_b: HashSet<_> = b.committed().await?.into_iter().collect();
    assert_eq!(raw.len(), by_b.len(), "zombie manifest left: {raw:?}");
    let loaded = b.load_step(2).await?;
    assert_same(&loaded.state, &f32_state(3, 3000, 22));
    no_chunk_missing(&b).await
}

/// A writer built before epochs existed (or with fencing off) commits with
/// epoch 0: what it committed before a claim stays valid, what it commits
/// after is a zombie's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unfenced_writer_counts_only_before_the_first_claim() -> Result<()> {
    let url = memory_root("unfenced");
    let mut o = opts(5);
    o.fencing = false;
    let old = open(&url, o).await?;
    old.save(1, &f32_state(2, 500, 1)).await?.wait().await?;
    let b = open(&url, opts(5)).await?;
    assert_eq!(b.claim().await?, Some(1));
    assert_eq!(b.claim().await?, Some(1), "claimed once per checkpointer");
    old.save(2, &f32_state(2, 500, 2)).await?.wait().await?;
    let loaded = b.load_latest().await?.expect("step 1");
    assert_eq!(loaded.id.step, 1);
    assert_eq!(loaded.manifest.epoch, 0);
    Ok(())
}

/// Claims on one root are ordered: concurrent claimants on a store with
/// atomic creates each get a distinct epoch.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_claims_get_distinct_epochs() -> Result<()> {
    let (_dir, url) = temp_root();
    let s = store::open_url(&url)?;
    let mut tasks = Vec::new();
    for i in 0..8 {
        let s = s.clone();
        tasks.push(tokio::spawn(async move {
            epoch::claim_next(s.as_ref(), &format!("n{i}"), epoch::ClaimStrength::Atomic).await
        }));
    }
    let mut got = Vec::new();
    for t in tasks {
        got.push(t.await.unwrap()?.epoch);
    }
    got.sort();
    assert_eq!(got, (1..=8).collect::<Vec<_>>());
    assert_eq!(epoch::current(s.as_ref()).await?, 8);
    Ok(())
}

/// GC keeps unreferenced objects younger than the grace period: they may be
/// a save in flight in another process.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gc_keeps_young_unreferenced_chunks() -> Result<()> {
    let url = memory_root("grace");
    let mut o = opts(1);
    o.gc_grace = Duration::from_secs(3600);
    let cp = open(&url, o.clone()).await?;
    cp.save(1, &f32_state(2, 3000, 1)).await?.wait().await?;
    let stray = layout::chunk_key(&"ab".repeat(32));
    cp.store()
        .put(&stray, PutPayload::from_static(b"in flight"))
        .await?;
    cp.save(2, &f32_state(2, 3000, 2)).await?.wait().await?;
    let report = cp.gc().await?;
    assert!(cp.store().head(&stray).await.is_ok(), "{report:?}");
    // Step 1's own chunks are young too: retired, but its chunks wait.
    assert_eq!(report.chunks_deleted, 0);
    o.gc_grace = Duration::ZERO;
    let now = open(&url, o).await?;
    let report = now.gc().await?;
    assert!(report.chunks_deleted > 0);
    assert!(matches!(
        now.store().head(&stray).await,
        Err(object_store::Error::NotFound { .. })
    ));
    // `now` claimed the root when it collected: the first writer is fenced.
    assert!(matches!(cp.gc().await, Err(Error::Fenced { .. })));
    assert!(now
        .store()
        .head(&Path::from("epochs/00000000000000000002.claim"))
        .await
        .is_ok());
    Ok(())
}

/// A damaged claim (truncated, as a disk or a fault campaign may leave it)
/// never stops a restart: it says nothing, so every committed checkpoint
/// counts, and the next writer claims the epoch after it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_damaged_claim_does_not_stop_a_restart() -> Result<()> {
    let (dir, url) = temp_root();
    let a = open(&url, opts(3)).await?;
    a.save(1, &f32_state(2, 500, 1)).await?.wait().await?;
    a.save(2, &f32_state(2, 500, 2)).await?.wait().await?;
    let claim = dir.path().join("epochs/00000000000000000001.claim");
    let bytes = std::fs::read(&claim)?;
    std::fs::write(&claim, &bytes[..bytes.len() / 2])?;
    let b = open(&url, opts(3)).await?;
    let loaded = b.load_latest().await?.expect("step 2");
    assert_eq!(loaded.id.step, 2);
    assert_same(&loaded.state, &f32_state(2, 500, 2));
    assert_eq!(b.claim().await?, Some(2));
    // The old writer is fenced by the new claim as usual.
    assert!(matches!(
        a.save(3, &f32_state(2, 500, 3)).await?.wait().await,
        Err(Error::Fenced { .. })
    ));
    b.save(3, &f32_state(2, 500, 33)).await?.wait().await?;
    assert_eq!(committed_steps(&b).await?, vec![1, 2, 3]);
    Ok(())
}
