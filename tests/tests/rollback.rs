//! A rollback: a job goes back to an earlier checkpoint (after a loss spike)
//! and trains on. `discard_after(step)` makes that checkpoint the newest, so
//! the job's new saves are accepted and a restart resumes from them, not
//! from the run it left. With fencing on, one epoch claim is the change:
//! whole or absent after a crash, on every tier, and refused to an older
//! incarnation.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use ckpt_core::layout;
use ckpt_core::store::{self, memory_store, FaultPlan, FaultStore};
use ckpt_core::{Checkpointer, CheckpointerOptions, Error, Result, Retention};
use ckpt_tests::*;
use futures::TryStreamExt;
use object_store::path::Path;
use object_store::ObjectStore;

async fn open(store: &Arc<dyn ObjectStore>, retention: Retention, fencing: bool) -> Checkpointer {
    let opts = CheckpointerOptions {
        retention,
        gc_grace: Duration::ZERO,
        fencing,
        ..Default::default()
    };
    ckpt_formats::builder("memory://unused")
        .store(store.clone())
        .options(opts)
        .build()
        .await
        .unwrap()
}

async fn saved(cp: &Checkpointer, step: u64) {
    cp.save(step, &f32_state(2, 256, step))
        .await
        .unwrap()
        .wait()
        .await
        .unwrap();
}

/// A checkpointer (keeping all, fencing on: it claims epoch 1) over `inner`
/// through a fault store that injects `plan` once steps 1 to 3 are saved.
async fn three_saves_then_faults(
    inner: &Arc<dyn ObjectStore>,
    plan: FaultPlan,
) -> (Arc<FaultStore>, Checkpointer) {
    let faulty = Arc::new(FaultStore::new(inner.clone(), plan));
    faulty.set_enabled(false);
    let store: Arc<dyn ObjectStore> = faulty.clone();
    let cp = open(&store, Retention::keep_all(), true).await;
    for step in 1..=3 {
        saved(&cp, step).await;
    }
    faulty.set_enabled(true);
    (faulty, cp)
}

async fn keys(store: &dyn ObjectStore, prefix: &str) -> Vec<Path> {
    let metas: Vec<_> = store
        .list(Some(&Path::from(prefix)))
        .try_collect()
        .await
        .unwrap();
    metas.into_iter().map(|m| m.location).collect()
}

#[tokio::test]
async fn a_rollback_discards_the_later_checkpoints_and_resumes_from_its_own_saves() {
    let store = memory_store(&memory_root("rollback"));
    let before = open(&store, Retention::keep_last(3), true).await;
    for step in [100, 200, 300, 400, 500] {
        saved(&before, step).await;
    }
    assert_eq!(committed_steps(&before).await.unwrap(), [300, 400, 500]);

    // The loss spiked after 300: a restart goes back to it.
    let cp = open(&store, Retention::keep_last(3), true).await;
    assert_eq!(cp.load_latest().await.unwrap().unwrap().id.step, 500);
    let back = cp.load_step(300).await.unwrap();
    assert_same(&f32_state(2, 256, 300), &back.state);
    // Saving on without discarding is refused: a restart would resume from 500.
    match cp.save(310, &f32_state(2, 256, 310)).await {
        Err(Error::Conflict(msg)) => assert!(
            msg.contains("step 310 comes before") && msg.contains("discard_after"),
            "{msg}"
        ),
        other => panic!("expected a conflict, got {other:?}"),
    }
    // A mistyped step discards nothing.
    match cp.discard_after(30).await {
        Err(Error::InvalidInput(msg)) => assert!(
            msg.contains("no committed checkpoint of step 30") && msg.contains("[300, 400, 500]"),
            "{msg}"
        ),
        other => panic!("expected invalid input, got {other:?}"),
    }
    assert_eq!(committed_steps(&cp).await.unwrap(), [300, 400, 500]);
    let report = cp.discard_after(300).await.unwrap();
    let retired: Vec<u64> = report.retired.iter().map(|id| id.step).collect();
    assert_eq!(retired, [400, 500]);
    assert_eq!(committed_steps(&cp).await.unwrap(), [300]);
    assert_eq!(keys(store.as_ref(), "manifests").await.len(), 1);
    for step in [310, 320] {
        saved(&cp, step).await;
    }

    // A restart resumes from the rolled-back run, bitwise.
    let restart = open(&store, Retention::keep_last(3), true).await;
    let loaded = restart.load_latest().await.unwrap().unwrap();
    assert_eq!(loaded.id.step, 320);
    assert_same(&f32_state(2, 256, 320), &loaded.state);
    assert_eq!(committed_steps(&restart).await.unwrap(), [300, 310, 320]);
    // No chunk is left that only the discarded checkpoints referenced.
    let mut live = HashSet::new();
    for id in restart.committed().await.unwrap() {
        let m = layout::read_manifest(store.as_ref(), &id).await.unwrap();
        live.extend(m.chunk_hashes().map(str::to_owned));
    }
    let stored: HashSet<String> = keys(store.as_ref(), "chunks")
        .await
        .iter()
        .filter_map(|k| k.filename().map(str::to_owned))
        .collect();
    assert_eq!(stored, live);
}

#[tokio::test]
async fn a_discard_by_an_older_incarnation_is_fenced_and_changes_nothing() {
    let store = memory_store(&memory_root("rollback-zombie"));
    let old = open(&store, Retention::keep_all(), true).await;
    for step in 1..=3 {
        saved(&old, step).await;
    }
    let new = open(&store, Retention::keep_all(), true).await;
    assert_eq!(new.load_latest().await.unwrap().unwrap().id.step, 3);
    match old.discard_after(1).await {
        Err(Error::Fenced { .. }) => {}
        other => panic!("expected Fenced, got {other:?}"),
    }
    assert_eq!(committed_steps(&new).await.unwrap(), [1, 2, 3]);
    assert_eq!(new.load_latest().await.unwrap().unwrap().id.step, 3);
    saved(&new, 4).await;
    // The new incarnation discards; the old one saves nothing more.
    new.discard_after(2).await.unwrap();
    assert_eq!(committed_steps(&new).await.unwrap(), [1, 2]);
    assert!(matches!(
        old.save(5, &f32_state(2, 256, 5)).await,
        Err(Error::Fenced { .. })
    ));
}

// The claim is the change: once it is made, a failure of the deletes after
// it leaves the rollback whole (the later checkpoints count no more), and a
// later GC deletes them.
#[tokio::test]
async fn a_discard_is_whole_once_claimed_even_when_its_deletes_fail() {
    let inner = memory_store(&memory_root("rollback-faults"));
    let mut plan = FaultPlan::none(7);
    plan.delete_error = 1.0;
    let (_, cp) = three_saves_then_faults(&inner, plan).await;
    assert!(matches!(cp.discard_after(1).await, Err(Error::Storage(_))));
    assert_eq!(keys(inner.as_ref(), "manifests").await.len(), 3);
    let restart = open(&inner, Retention::keep_all(), true).await;
    assert_eq!(restart.load_latest().await.unwrap().unwrap().id.step, 1);
    assert_eq!(committed_steps(&restart).await.unwrap(), [1]);
    // The discarded steps are saved again beside their old manifests.
    saved(&restart, 2).await;
    assert_same(
        &f32_state(2, 256, 2),
        &restart.load_latest().await.unwrap().unwrap().state,
    );
    let report = restart.gc().await.unwrap();
    assert_eq!(report.retired.len(), 2, "{report:?}");
    assert_eq!(keys(inner.as_ref(), "manifests").await.len(), 2);
}

// The claim's put lands but reading it back fails: the writer must carry on
// under the claim it made, not be fenced by it.
#[tokio::test]
async fn a_claim_whose_read_back_fails_is_still_the_writers_own() {
    let inner = memory_store(&memory_root("rollback-read-back"));
    let mut plan = FaultPlan::none(11);
    plan.get_error = 1.0;
    plan.max_faults = Some(1);
    plan.only_prefix = Some("epochs/00000000000000000002.claim".into());
    let (faulty, cp) = three_saves_then_faults(&inner, plan).await;
    let report = cp.discard_after(1).await.unwrap();
    assert_eq!(faulty.injected().errors, 1, "the read-back was not faulted");
    assert_eq!(
        report.retired.iter().map(|id| id.step).collect::<Vec<_>>(),
        [2, 3]
    );
    saved(&cp, 2).await;
    assert_eq!(committed_steps(&cp).await.unwrap(), [1, 2]);
}

#[tokio::test]
async fn with_fencing_off_the_deletes_discard() {
    let store = memory_store(&memory_root("rollback-unfenced"));
    let cp = open(&store, Retention::keep_all(), false).await;
    for step in 1..=3 {
        saved(&cp, step).await;
    }
    let report = cp.discard_after(1).await.unwrap();
    assert_eq!(
        report.retired.iter().map(|id| id.step).collect::<Vec<_>>(),
        [2, 3]
    );
    assert!(keys(store.as_ref(), "epochs").await.is_empty());
    assert_eq!(keys(store.as_ref(), "manifests").await.len(), 1);
    saved(&cp, 2).await;
    assert_eq!(committed_steps(&cp).await.unwrap(), [1, 2]);
    // Nothing after the step: nothing to discard.
    assert!(cp.discard_after(2).await.unwrap().retired.is_empty());

    let opts = CheckpointerOptions {
        read_only: true,
        ..Default::default()
    };
    let reader = ckpt_formats::builder("memory://unused")
        .store(store.clone())
        .options(opts)
        .build()
        .await
        .unwrap();
    assert!(matches!(
        reader.discard_after(0).await,
        Err(Error::InvalidInput(_))
    ));
    assert_eq!(committed_steps(&cp).await.unwrap(), [1, 2]);
}

// On a tiered store deletes act on the fast tier only; the claim, written
// through, makes the rollback hold on the durable tier too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rollback_on_a_tiered_store_holds_on_the_durable_tier() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let fast = dir.path().join("fast");
    let url = format!(
        "tiered+file://{}?durable=file://{}/durable",
        fast.display(),
        dir.path().display()
    );
    let tiered = store::open_tiered(&url)?;
    let cp = open(
        &(Arc::new(tiered.clone()) as _),
        Retention::keep_all(),
        true,
    )
    .await;
    for step in 1..=3 {
        saved(&cp, step).await;
    }
    tiered.flush().await?;
    cp.load_step(1).await?;
    cp.discard_after(1).await?;
    cp.save(2, &f32_state(2, 256, 22)).await?.wait().await?;
    let report = tiered.flush().await?;
    assert!(report.failed.is_empty(), "{:?}", report.failed);

    std::fs::remove_dir_all(&fast)?; // the node is lost
    let tiered = store::open_tiered(&url)?;
    let restart = open(&(Arc::new(tiered) as _), Retention::keep_all(), true).await;
    let loaded = restart.load_latest().await?.expect("a checkpoint");
    assert_eq!(loaded.id.step, 2);
    assert_same(&f32_state(2, 256, 22), &loaded.state);
    assert_eq!(committed_steps(&restart).await?, [1, 2]);
    Ok(())
}
