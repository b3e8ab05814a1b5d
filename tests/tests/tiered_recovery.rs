//! The tiered store: flush to the durable tier with its own commit, recovery after
//! the fast tier is wiped, the newest checkpoint on either tier, retention per
//! tier, and the durable manifest written only after everything it references.

use std::sync::Arc;
use std::time::Duration;

use ckpt_core::layout;
use ckpt_core::store::{self, FaultPlan, FaultStore};
use ckpt_core::{Checkpointer, Error, Result, Retention, State, Tensor, Value};
use ckpt_core::{TieredCheckpointStore, TieredOptions};
use futures::TryStreamExt;
use object_store::ObjectStore;

fn state(step: u64) -> State {
    // One tensor changes every step, one never does (shared chunks across checkpoints).
    let moving: Vec<f32> = (0..40_000).map(|i| (step * 1000 + i) as f32).collect();
    let frozen: Vec<f32> = (0..30_000).map(|i| i as f32 * 0.25).collect();
    State::new()
        .with_tensor(Tensor::from_f32("moving", vec![moving.len() as u64], &moving).unwrap())
        .with_tensor(Tensor::from_f32("frozen", vec![frozen.len() as u64], &frozen).unwrap())
        .with_meta(Value::map([("step", Value::Int(step as i64))]))
}

async fn checkpointer(store: Arc<dyn ObjectStore>, retention: Retention) -> Result<Checkpointer> {
    let mut opts = ckpt_core::CheckpointerOptions::default();
    opts.write.chunk_size = 64 << 10;
    opts.retention = retention;
    opts.gc_grace = Duration::ZERO;
    ckpt_formats::builder("tiered-test")
        .store(store)
        .options(opts)
        .build()
        .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wiped_fast_tier_recovers_from_durable() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let fast_dir = dir.path().join("fast");
    let url = format!(
        "tiered+file://{}?durable=file://{}/durable",
        fast_dir.display(),
        dir.path().display()
    );
    let tiered = store::open_tiered(&url)?;
    let cp = checkpointer(Arc::new(tiered.clone()), Retention::keep_all()).await?;
    for step in 1..=3 {
        cp.save(step, &state(step)).await?.wait().await?;
    }
    let report = tiered.flush().await?;
    assert!(report.failed.is_empty(), "{:?}", report.failed);
    assert_eq!(
        report.flushed.iter().map(|id| id.step).collect::<Vec<_>>(),
        vec![1, 2, 3]
    );

    // The node-local disk is lost.
    std::fs::remove_dir_all(&fast_dir)?;
    let tiered = store::open_tiered(&url)?;
    let cp = checkpointer(Arc::new(tiered.clone()), Retention::keep_all()).await?;
    let loaded = cp
        .load_latest()
        .await?
        .expect("the durable tier has checkpoints");
    assert_eq!(loaded.id.step, 3);
    assert_eq!(loaded.state, state(3));
    assert!(loaded.skipped.is_empty());
    for id in cp.committed().await? {
        cp.verify(&id).await?;
    }

    // Training goes on from there; the new checkpoint reaches the durable tier too.
    cp.save(4, &state(4)).await?.wait().await?;
    tiered.flush().await?;
    let durable = ckpt_formats::builder("d")
        .store(tiered.durable().clone())
        .build()
        .await?;
    let loaded = durable.load_latest().await?.expect("step 4 was flushed");
    assert_eq!((loaded.id.step, loaded.state), (4, state(4)));
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn newest_on_either_tier_and_failed_flush_is_retried() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let fast = store::open_dir(&dir.path().join("fast"))?;
    let durable_inner = store::open_dir(&dir.path().join("durable"))?;
    // The durable tier refuses every put for now (a real outage cannot be staged here).
    let durable = FaultStore::new(
        durable_inner.clone(),
        FaultPlan {
            put_error: 1.0,
            ..FaultPlan::none(1)
        },
    );
    let opts = TieredOptions {
        attempts: 2,
        backoff: Duration::from_millis(5),
        ..Default::default()
    };
    let tiered = TieredCheckpointStore::new(fast, Arc::new(durable.clone()), opts);
    let cp = checkpointer(Arc::new(tiered.clone()), Retention::keep_all()).await?;
    cp.save(1, &state(1)).await?.wait().await?;
    cp.save(2, &state(2)).await?.wait().await?;

    let report = tiered.flush().await?;
    assert_eq!(
        report.failed.len(),
        2,
        "both flushes must fail: {:?}",
        report.flushed
    );
    assert!(report
        .failed
        .iter()
        .all(|(_, e)| matches!(e, Error::Storage(_))));
    assert!(
        layout::committed(durable_inner.as_ref()).await?.is_empty(),
        "a manifest reached the durable tier"
    );
    // Training does not care: the fast tier has the newest.
    let loaded = cp.load_latest().await?.expect("fast tier checkpoint");
    assert_eq!((loaded.id.step, loaded.state), (2, state(2)));

    // The outage ends: the next flush picks both up again.
    durable.set_enabled(false);
    let report = tiered.flush().await?;
    assert!(report.failed.is_empty(), "{:?}", report.failed);
    assert_eq!(report.flushed.len(), 2);
    assert_eq!(layout::committed(durable_inner.as_ref()).await?.len(), 2);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn durable_manifest_only_after_every_chunk() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let fast = store::open_dir(&dir.path().join("fast"))?;
    let durable_inner = store::open_dir(&dir.path().join("durable"))?;
    // The checkpoint is committed on the fast tier first, so that one of its
    // chunks can be named: that chunk's copy to the durable tier always fails
    // (every attempt, also the retry a later flush makes), the others land.
    checkpointer(fast.clone(), Retention::keep_all())
        .await?
        .save(1, &state(1))
        .await?
        .wait()
        .await?;
    let chunks: Vec<_> = fast
        .list(Some(&"chunks".into()))
        .map_ok(|m| m.location.to_string())
        .try_collect()
        .await?;
    assert!(chunks.len() >= 2, "{chunks:?}");
    let plan = FaultPlan {
        put_error: 1.0,
        only_prefix: Some(chunks[0].clone()),
        ..FaultPlan::none(9)
    };
    let durable = FaultStore::new(durable_inner.clone(), plan);
    let opts = TieredOptions {
        attempts: 1,
        ..Default::default()
    };
    let tiered = TieredCheckpointStore::new(fast, Arc::new(durable.clone()), opts);
    let report = tiered.flush().await?;
    assert_eq!(durable.injected().errors, 1);
    assert_eq!(report.failed.len(), 1, "{:?}", report.flushed);
    assert!(report.flushed.is_empty());
    assert!(
        layout::committed(durable_inner.as_ref()).await?.is_empty(),
        "manifest published before its chunks"
    );
    // The durable tier holds at most an incomplete, invisible copy.
    let landed: Vec<_> = durable_inner
        .list(Some(&"chunks".into()))
        .try_collect()
        .await?;
    assert!(landed.len() < chunks.len());
    let on_durable = ckpt_formats::builder("d")
        .store(durable_inner.clone())
        .build()
        .await?;
    assert!(on_durable.load_latest().await?.is_none());
    // A second flush tries again, and fails again the same way.
    let report = tiered.flush().await?;
    assert_eq!((report.failed.len(), durable.injected().errors), (1, 2));
    assert!(layout::committed(durable_inner.as_ref()).await?.is_empty());
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retention_per_tier_with_deletes_deferred_until_flushed() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let fast = store::open_dir(&dir.path().join("fast"))?;
    let durable_inner = store::open_dir(&dir.path().join("durable"))?;
    // A slow durable tier, so the fast tier's retention runs while flushes are queued.
    let slow = FaultStore::new(
        durable_inner.clone(),
        FaultPlan {
            latency: Duration::from_millis(20),
            ..FaultPlan::none(3)
        },
    );
    let opts = TieredOptions {
        durable_retention: Retention::keep_last(3),
        durable_grace: Duration::ZERO,
        ..Default::default()
    };
    let tiered = TieredCheckpointStore::new(fast.clone(), Arc::new(slow), opts);
    let cp = checkpointer(Arc::new(tiered.clone()), Retention::keep_last(1)).await?;
    for step in 1..=5 {
        cp.save(step, &state(step)).await?.wait().await?;
    }
    let report = tiered.flush().await?;
    assert!(report.failed.is_empty(), "{:?}", report.failed);
    // Every checkpoint was flushed, even those the fast tier retired before their flush.
    assert_eq!(report.flushed.len(), 5, "flushed: {:?}", report.flushed);
    assert!(tiered.pending().is_empty());

    let steps =
        |ids: Vec<ckpt_core::CheckpointId>| ids.into_iter().map(|id| id.step).collect::<Vec<_>>();
    assert_eq!(
        steps(layout::committed(fast.as_ref()).await?),
        vec![5],
        "fast tier keeps the newest only"
    );
    assert_eq!(
        steps(layout::committed(durable_inner.as_ref()).await?),
        vec![3, 4, 5],
        "durable tier keeps three"
    );
    // Deferred deletes ran: nothing of the retired checkpoints is left on the fast tier.
    assert!(layout::incomplete(fast.as_ref()).await?.is_empty());
    // Every checkpoint the durable tier kept loads intact, through the tiered store too.
    let on_durable = ckpt_formats::builder("d")
        .store(durable_inner.clone())
        .build()
        .await?;
    for id in layout::committed(durable_inner.as_ref()).await? {
        assert_eq!(on_durable.load(&id).await?.state, state(id.step));
        assert_eq!(cp.load(&id).await?.state, state(id.step));
    }
    Ok(())
}

/// A restarted writer claims the next epoch (written through to the durable
/// tier) before anything it flushes carries that epoch. Its durable
/// retention runs under that claim of its own: fenced by it, every restart's
/// first flushes (the fast tier's checkpoints the durable tier lacks, picked
/// up again) skipped retention with a warning until the writer's first save
/// was flushed, and what they put back on the durable tier stayed there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_writers_durable_retention_runs_under_its_own_claim() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let fast = store::open_dir(&dir.path().join("fast"))?;
    let durable = store::open_dir(&dir.path().join("durable"))?;
    let steps =
        |ids: Vec<ckpt_core::CheckpointId>| ids.into_iter().map(|id| id.step).collect::<Vec<_>>();
    // The durable tier keeps two, the fast tier everything.
    let opts = TieredOptions {
        durable_retention: Retention::keep_last(2),
        durable_grace: Duration::ZERO,
        ..Default::default()
    };
    {
        let tiered = TieredCheckpointStore::new(fast.clone(), durable.clone(), opts.clone());
        let cp = checkpointer(Arc::new(tiered.clone()), Retention::keep_all()).await?;
        for step in 1..=3 {
            cp.save(step, &state(step)).await?.wait().await?;
        }
        assert!(tiered.flush().await?.failed.is_empty());
    }
    assert_eq!(steps(layout::committed(durable.as_ref()).await?), [2, 3]);
    assert_eq!(layout::epoch::current(durable.as_ref()).await?, 1);
    // The restart: it claims epoch 2, and its first flush puts 1 back on the
    // durable tier (the fast tier holds it, the durable tier does not), then
    // retires it again, before the restart saved anything.
    let tiered = TieredCheckpointStore::new(fast.clone(), durable.clone(), opts);
    let cp = checkpointer(Arc::new(tiered.clone()), Retention::keep_all()).await?;
    assert_eq!(cp.load_latest().await?.expect("a checkpoint").id.step, 3);
    assert_eq!(
        layout::epoch::current(durable.as_ref()).await?,
        2,
        "claimed through"
    );
    let report = tiered.flush().await?;
    assert!(report.failed.is_empty(), "{:?}", report.failed);
    assert_eq!(steps(report.flushed), [1]);
    assert_eq!(steps(layout::committed(durable.as_ref()).await?), [2, 3]);
    // A rollback to 2 claims epoch 3, which leaves 3 to a fenced writer: the
    // durable retention after the next save retires it.
    cp.load_step(2).await?;
    cp.discard_after(2).await?;
    assert_eq!(layout::epoch::current(durable.as_ref()).await?, 3);
    cp.save(4, &state(40)).await?.wait().await?;
    assert!(tiered.flush().await?.failed.is_empty());
    assert_eq!(steps(layout::committed(durable.as_ref()).await?), [2, 4]);
    Ok(())
}

#[tokio::test]
async fn tiered_urls_are_checked() {
    let bad = [
        "tiered+file:///tmp/x",
        "tiered+?durable=memory://d",
        "tiered+memory://a?durable=memory://a",
        "tiered+memory://a?durable=memory://b&keep=3",
        "tiered+memory://a?durable=memory://b&durable_keep_last=x",
    ];
    for url in bad {
        assert!(
            matches!(store::open_url(url), Err(Error::InvalidInput(_))),
            "{url} was accepted"
        );
    }
    assert!(store::open_url("tiered+memory://a?durable=memory://b&durable_keep_last=4").is_ok());
}
