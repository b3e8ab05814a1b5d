//! A save stopped at each step of the commit protocol never becomes the latest
//! checkpoint: `load_latest` after a restart returns the previous one.
//!
//! Failpoints are process-global, so this file holds one test that walks every
//! point in turn.

use ckpt_core::failpoint;
use ckpt_tests::*;

#[tokio::test]
async fn save_stopped_at_every_step_leaves_previous_checkpoint() {
    let points = [
        ("save.start", "error"),
        ("save.before_data", "error"),
        ("save.mid_data", "1*error"),
        ("save.mid_data", "5*error"),
        ("save.after_data", "error"),
        ("save.before_manifest", "error"),
    ];
    for (i, (point, action)) in points.iter().enumerate() {
        let (_dir, url) = temp_root();
        let good = f32_state(4, 3000, 10);
        let cp = open_small_chunks(&url).await;
        cp.save(100, &good).await.unwrap().wait().await.unwrap();

        failpoint::set(point, action);
        let next = f32_state(4, 3000, 20 + i as u64);
        let outcome = match cp.save(200, &next).await {
            Ok(h) => h.wait().await,
            Err(e) => Err(e),
        };
        failpoint::clear_all();
        assert!(outcome.is_err(), "{point}={action}: the save must fail");

        // Restart: a fresh checkpointer over the same directory.
        let cp2 = open_small_chunks(&url).await;
        let loaded = cp2
            .load_latest()
            .await
            .unwrap()
            .expect("previous checkpoint");
        assert_eq!(loaded.id.step, 100, "{point}: torn save became latest");
        assert_same(&good, &loaded.state);
        let listed = cp2.list(false).await.unwrap();
        assert_eq!(
            listed
                .iter()
                .filter(|c| c.status == ckpt_core::Status::Committed)
                .count(),
            1
        );

        // The job goes on: the same step saves cleanly now.
        cp2.save(200, &next).await.unwrap().wait().await.unwrap();
        let latest = cp2.load_latest().await.unwrap().unwrap();
        assert_eq!(latest.id.step, 200);
        assert_same(&next, &latest.state);
    }

    // After the manifest is published the checkpoint exists, even if the process
    // dies right after.
    let (_dir, url) = temp_root();
    let cp = open_small_chunks(&url).await;
    let s = f32_state(2, 100, 1);
    failpoint::set("save.after_manifest", "error");
    let r = cp.save(7, &s).await.unwrap().wait().await;
    failpoint::clear_all();
    assert!(r.is_err());
    let loaded = open_small_chunks(&url)
        .await
        .load_latest()
        .await
        .unwrap()
        .unwrap();
    assert_eq!(loaded.id.step, 7);
    assert_same(&s, &loaded.state);
}
