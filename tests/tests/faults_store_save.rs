//! Saves through a store that fails, tears writes, loses acknowledgements and
//! times out by a seeded plan: each save either succeeds (with retries) or fails
//! cleanly, and `load_latest` never returns a torn or corrupt checkpoint.
//!
//! The faults come from `FaultStore` over a real local directory: no real disk or
//! S3 server can be made to fail on cue, so this is the one place a test double
//! stands in, and it only decides when the real store's operations fail.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use ckpt_core::store::{self, FaultPlan, FaultStore, RetryOptions, RetryStore};
use ckpt_core::{Checkpointer, CheckpointerOptions, Result, Retention, State, Tensor, Value};
use object_store::ObjectStore;

fn state(step: u64) -> State {
    let moving: Vec<f32> = (0..24_000).map(|i| (step * 7 + i) as f32).collect();
    let frozen: Vec<f32> = (0..16_000).map(|i| -(i as f32)).collect();
    State::new()
        .with_tensor(Tensor::from_f32("moving", vec![moving.len() as u64], &moving).unwrap())
        .with_tensor(Tensor::from_f32("frozen", vec![frozen.len() as u64], &frozen).unwrap())
        .with_meta(Value::map([("step", Value::Int(step as i64))]))
}

async fn checkpointer(store: Arc<dyn ObjectStore>, retention: Retention) -> Result<Checkpointer> {
    let mut opts = CheckpointerOptions::default();
    opts.write.chunk_size = 16 << 10; // several chunks per tensor, so faults hit mid-save
    opts.retention = retention;
    ckpt_formats::builder("faults")
        .store(store)
        .options(opts)
        .build()
        .await
}

/// Save steps 1..=n through `store`; returns which steps reported success.
async fn save_all(cp: &Checkpointer, n: u64) -> BTreeMap<u64, bool> {
    let mut out = BTreeMap::new();
    for step in 1..=n {
        let ok = match cp.save(step, &state(step)).await {
            Ok(h) => h.wait().await.is_ok(),
            Err(_) => false,
        };
        out.insert(step, ok);
    }
    out
}

/// The property every run must keep: whatever `load_latest` returns is exactly the
/// state saved at its step, and it is at least as new as the newest save that
/// reported success.
async fn check_latest(
    store: Arc<dyn ObjectStore>,
    outcomes: &BTreeMap<u64, bool>,
    seed: u64,
) -> Result<()> {
    let cp = checkpointer(store, Retention::keep_all()).await?;
    let newest_ok = outcomes
        .iter()
        .filter(|(_, ok)| **ok)
        .map(|(s, _)| *s)
        .max();
    match cp.load_latest().await? {
        Some(loaded) => {
            assert_eq!(
                loaded.state,
                state(loaded.id.step),
                "seed {seed}: load_latest returned wrong data"
            );
            assert!(
                newest_ok.is_none_or(|s| loaded.id.step >= s),
                "seed {seed}: loaded step {} but step {newest_ok:?} was saved successfully",
                loaded.id.step
            );
            for (id, why) in &loaded.skipped {
                assert!(
                    why.is_damage(),
                    "seed {seed}: {id} skipped for a non-damage error: {why}"
                );
            }
        }
        None => assert_eq!(
            newest_ok, None,
            "seed {seed}: nothing loads although a save succeeded"
        ),
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_retries_saves_fail_cleanly_and_nothing_torn_loads() -> Result<()> {
    let mut failed = 0;
    let mut faults = 0;
    for seed in 0..12u64 {
        let dir = tempfile::tempdir()?;
        let disk = store::open_dir(dir.path())?;
        let plan = FaultPlan {
            timeout: Duration::from_millis(30),
            ..FaultPlan::flaky_puts(seed, 0.08)
        };
        let faulty = FaultStore::new(disk.clone(), plan);
        let cp = checkpointer(Arc::new(faulty.clone()), Retention::keep_last(2)).await?;
        let outcomes = save_all(&cp, 6).await;
        failed += outcomes.values().filter(|ok| !**ok).count();
        faults += faulty.injected().total();
        check_latest(disk, &outcomes, seed).await?;
    }
    // The plan must really have hurt: otherwise this test proves nothing.
    assert!(
        faults > 10 && failed > 5,
        "too few faults ({faults}) or failed saves ({failed})"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_retries_saves_succeed_despite_errors_timeouts_and_lost_acks() -> Result<()> {
    for seed in 100..108u64 {
        let dir = tempfile::tempdir()?;
        let disk = store::open_dir(dir.path())?;
        let plan = FaultPlan {
            put_error: 0.1,
            put_timeout: 0.05,
            put_lost_ack: 0.1,
            get_error: 0.05,
            list_error: 0.05,
            timeout: Duration::from_secs(5),
            ..FaultPlan::none(seed)
        };
        let faulty = FaultStore::new(disk.clone(), plan);
        let opts = RetryOptions {
            max_retries: 10,
            init_backoff: Duration::from_millis(1),
            max_backoff: Duration::from_millis(20),
            attempt_timeout: Some(Duration::from_millis(200)), // shorter than the injected hang
        };
        let retrying: Arc<dyn ObjectStore> =
            Arc::new(RetryStore::new(Arc::new(faulty.clone()), opts));
        let cp = checkpointer(retrying.clone(), Retention::keep_all()).await?;
        let outcomes = save_all(&cp, 4).await;
        let injected = faulty.injected();
        assert!(injected.total() > 0, "seed {seed}: no fault injected");
        assert!(
            outcomes.values().all(|ok| *ok),
            "seed {seed}: a save failed despite retries: {outcomes:?} ({injected:?})"
        );
        // Loading through the faulty store (with retries) finds the newest, exactly.
        let loaded = cp.load_latest().await?.expect("checkpoints exist");
        assert_eq!(
            (loaded.id.step, &loaded.state),
            (4, &state(4)),
            "seed {seed}"
        );
        check_latest(disk, &outcomes, seed).await?;
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn flaky_reads_never_make_an_older_checkpoint_look_newest() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let disk = store::open_dir(dir.path())?;
    let cp = checkpointer(disk.clone(), Retention::keep_all()).await?;
    for step in 1..=3 {
        cp.save(step, &state(step)).await?.wait().await?;
    }
    for seed in 0..20u64 {
        let faulty = FaultStore::new(
            disk.clone(),
            FaultPlan {
                get_error: 0.3,
                ..FaultPlan::none(seed)
            },
        );
        let cp = checkpointer(Arc::new(faulty), Retention::keep_all()).await?;
        match cp.load_latest().await {
            // A storage failure is reported, never mistaken for damage.
            Err(e) => assert!(!e.is_damage(), "seed {seed}: {e}"),
            Ok(Some(loaded)) => {
                assert_eq!((loaded.id.step, loaded.state), (3, state(3)), "seed {seed}")
            }
            Ok(None) => panic!("seed {seed}: checkpoints vanished"),
        }
    }
    Ok(())
}
