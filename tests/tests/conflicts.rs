//! A step is committed once: `save` refuses a step this checkpointer knows is
//! committed (listed by its load or its first save, then kept up to date) without asking
//! the store, and the commit refuses a step another
//! writer committed while the save ran, as a typed `Conflict`, publishing
//! nothing and leaving the other writer's checkpoint as it was.

use std::sync::Arc;

use ckpt_core::store::{memory_store, CountingStore};
use ckpt_core::{Checkpointer, Error, Retention};
use ckpt_tests::*;
use futures::TryStreamExt;
use object_store::ObjectStoreExt;

async fn open(counting: &Arc<CountingStore>) -> Checkpointer {
    ckpt_formats::builder("memory://unused")
        .store(counting.clone())
        .retention(Retention::keep_last(2))
        .build()
        .await
        .unwrap()
}

// One thread: the save's background task cannot run (and read the store)
// before `save` has returned and the counts are taken.
#[tokio::test]
async fn starting_a_save_of_a_new_step_reads_nothing_from_storage() {
    let counting = Arc::new(CountingStore::new(memory_store(&memory_root("no-list"))));
    let cp = open(&counting).await;
    // The first save lists the checkpoints under the root, once.
    cp.save(1, &f32_state(3, 64, 1))
        .await
        .unwrap()
        .wait()
        .await
        .unwrap();
    for step in 2..=4 {
        let before = counting.counts();
        let h = cp.save(step, &f32_state(3, 64, step)).await.unwrap();
        let during = counting.counts() - before;
        assert_eq!(
            (during.lists, during.gets, during.heads),
            (0, 0, 0),
            "save({step}) went to the store before returning: {during:?}"
        );
        h.wait().await.unwrap();
    }
    // Its own commits are known: the step is refused at once, the stored one kept.
    assert!(matches!(
        cp.save(4, &f32_state(3, 64, 99)).await,
        Err(Error::Conflict(_))
    ));
    assert_same(&f32_state(3, 64, 4), &cp.load_step(4).await.unwrap().state);
    // What its retention retired (keep_last(2) retired 1 and 2) is not
    // committed any more, but a save of it comes before later checkpoints
    // (and would be retired by its own commit): refused as that, not as a
    // step already committed.
    match cp.save(1, &f32_state(3, 64, 11)).await {
        Err(Error::Conflict(msg)) => assert!(
            msg.contains("step 1 comes before 2 committed")
                && msg.contains("(4, 3)")
                && msg.contains("would retire it as soon as it commits"),
            "{msg}"
        ),
        other => panic!("expected a conflict, got {other:?}"),
    }
}

// A job that went back to an earlier step (a rollback, or a restart that did
// not load) saved checkpoints that a restart never came back to: load_latest
// resumed from the newest old one (and with keep_last, retention retired each
// new one as it committed). Such a save is refused, whatever the retention,
// before anything is written; a later checkpoint a load found damaged does
// not count.
#[tokio::test]
async fn a_save_before_a_committed_later_step_is_refused() {
    let store = memory_store(&memory_root("before-later"));
    let open = |retention: Retention| {
        ckpt_formats::builder("memory://unused")
            .store(store.clone())
            .retention(retention)
            .build()
    };
    async fn saved(cp: &Checkpointer, step: u64) {
        let h = cp.save(step, &f32_state(2, 64, step)).await.unwrap();
        h.wait().await.unwrap();
    }
    let cp = open(Retention::keep_last(2)).await.unwrap();
    for step in [10, 20, 30, 40] {
        saved(&cp, step).await;
    }
    let data_before = store
        .list(None)
        .try_collect::<Vec<_>>()
        .await
        .unwrap()
        .len();
    let every = Retention {
        keep_last: Some(2),
        keep_every: Some(5),
    };
    let restart = open(Retention::keep_last(2)).await.unwrap();
    let archive = open(every).await.unwrap();
    let all = open(Retention::keep_all()).await.unwrap();
    for (c, step, retired) in [
        (&cp, 35, false),
        (&cp, 5, true),
        (&restart, 5, true),
        (&archive, 5, false),
        (&all, 6, false),
    ] {
        match c.save(step, &f32_state(2, 64, step)).await {
            Err(Error::Conflict(msg)) => {
                assert!(msg.contains(&format!("step {step} comes before")), "{msg}");
                assert!(msg.contains("discard_after"), "{msg}");
                assert_eq!(msg.contains("would retire it"), retired, "{msg}");
            }
            other => panic!("expected a conflict, got {other:?}"),
        }
    }
    assert_eq!(committed_steps(&restart).await.unwrap(), [30, 40]);
    let data_after = store
        .list(None)
        .try_collect::<Vec<_>>()
        .await
        .unwrap()
        .len();
    assert_eq!(data_before, data_after, "a refused save wrote something");

    // A load that finds 40 damaged passes over it; then 35 may be saved.
    store
        .put(
            &ckpt_core::layout::manifest_key(&restart.committed().await.unwrap()[1]),
            b"not a manifest".to_vec().into(),
        )
        .await
        .unwrap();
    let reload = open(Retention::keep_last(2)).await.unwrap();
    assert_eq!(reload.load_latest().await.unwrap().unwrap().id.step, 30);
    saved(&reload, 35).await;
    assert_eq!(reload.load_latest().await.unwrap().unwrap().id.step, 35);
}

// A restart lists the checkpoints to load the newest; its first save uses
// that listing instead of listing again in its stall (a round trip on S3).
#[tokio::test]
async fn a_restarts_first_save_uses_the_listing_of_its_load() {
    let counting = Arc::new(CountingStore::new(memory_store(&memory_root(
        "restart-list",
    ))));
    let before = open(&counting).await;
    for step in 1..=2 {
        let h = before.save(step, &f32_state(3, 64, step)).await.unwrap();
        h.wait().await.unwrap();
    }
    let cp = open(&counting).await;
    let ids = cp.committed().await.unwrap();
    assert_eq!(ids.iter().map(|id| id.step).collect::<Vec<_>>(), [1, 2]);
    let start = counting.counts();
    let h = cp.save(3, &f32_state(3, 64, 3)).await.unwrap();
    let during = counting.counts() - start;
    assert_eq!(during.lists, 0, "the first save listed again: {during:?}");
    h.wait().await.unwrap();
    // What the load listed is known: a committed step is refused at once.
    assert!(matches!(
        cp.save(2, &f32_state(3, 64, 99)).await,
        Err(Error::Conflict(_))
    ));
    assert_same(&f32_state(3, 64, 2), &cp.load_step(2).await.unwrap().state);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_step_another_writer_committed_meanwhile_is_a_conflict_at_commit() {
    let counting = Arc::new(CountingStore::new(memory_store(&memory_root(
        "two-writers",
    ))));
    let first = open(&counting).await;
    let second = open(&counting).await;
    // `second` lists what is committed with its first save, before `first`
    // commits step 7.
    second
        .save(1, &f32_state(2, 128, 0))
        .await
        .unwrap()
        .wait()
        .await
        .unwrap();
    let theirs = f32_state(2, 128, 1);
    first.save(7, &theirs).await.unwrap().wait().await.unwrap();

    let h = second
        .save(7, &f32_state(2, 128, 2))
        .await
        .expect("`second` does not know of step 7 yet");
    match h.wait().await {
        Err(Error::Conflict(msg)) => assert!(msg.contains("step 7"), "{msg}"),
        other => panic!("expected a conflict at commit, got {other:?}"),
    }
    let fresh = open(&counting).await;
    let ids: Vec<_> = fresh
        .committed()
        .await
        .unwrap()
        .into_iter()
        .filter(|id| id.step == 7)
        .collect();
    assert_eq!(ids.len(), 1, "one manifest of step 7: {ids:?}");
    assert_same(&theirs, &fresh.load_step(7).await.unwrap().state);

    // Once it has failed there, `second` refuses the step at once too.
    assert!(matches!(
        second.save(7, &f32_state(2, 128, 3)).await,
        Err(Error::Conflict(_))
    ));
    // And a checkpointer built afterwards knows the step from its listing.
    assert!(matches!(
        fresh.save(7, &f32_state(2, 128, 4)).await,
        Err(Error::Conflict(_))
    ));
}
