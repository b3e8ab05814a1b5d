//! Engine failures, driven by failpoints: the busy policy and persist errors.
//!
//! Failpoints are process-global: every test here holds `SERIAL` so that no two
//! run at once (and no test of another file shares this process).

use ckpt_core::{BusyPolicy, Error};
use ckpt_tests::*;

static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn skip_policy_skips_when_the_budget_is_spent() {
    use ckpt_core::failpoint;
    let _serial = SERIAL.lock().await;
    // Hold the first save in its persist phase so its staging stays in use.
    let url = memory_root("skip");
    let cp = ckpt_formats::builder(&url)
        .staging_budget(4 * 100_000 + 4096)
        .busy(BusyPolicy::Skip)
        .build()
        .await
        .unwrap();
    let (_v1, cap1) = mutable_state(1, 100_000, 1);
    let (_v2, cap2) = mutable_state(1, 100_000, 2);
    failpoint::set("save.before_data", "sleep(500)");
    let h1 = cp.save(1, cap1).await.unwrap();
    let err = cp.save(2, cap2).await.unwrap_err();
    failpoint::clear_all();
    assert!(matches!(err, Error::Skipped { step: 2, .. }), "{err:?}");
    h1.wait().await.unwrap();
    // Once the first is done, the budget is free again.
    let (_v3, cap3) = mutable_state(1, 100_000, 3);
    cp.save(3, cap3).await.unwrap().wait().await.unwrap();
    let steps = committed_steps(&cp).await.unwrap();
    assert_eq!(steps, vec![1, 3]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_persist_error_surfaces_on_the_handle_and_on_the_next_save() {
    use ckpt_core::failpoint;
    let _serial = SERIAL.lock().await;
    let url = memory_root("persist-error");
    let cp = ckpt_formats::builder(&url).build().await.unwrap();
    failpoint::set("save.before_manifest", "error");
    let h = cp.save(1, &f32_state(2, 100, 1)).await.unwrap();
    // Not observed: wait until it has failed, then the next save reports it.
    while !h.is_finished() {
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
    failpoint::clear_all();
    drop(h);
    let err = cp.save(2, &f32_state(2, 100, 2)).await.unwrap_err();
    assert!(err.to_string().contains("step 1"), "{err}");
    // Reported once: the save after that goes through.
    cp.save(3, &f32_state(2, 100, 3))
        .await
        .unwrap()
        .wait()
        .await
        .unwrap();

    failpoint::set("save.after_data", "error");
    let h = cp.save(4, &f32_state(2, 100, 4)).await.unwrap();
    let err = h.wait().await.unwrap_err();
    failpoint::clear_all();
    assert!(err.to_string().contains("failpoint"), "{err}");
    // Observed on the handle: the next save is not refused.
    cp.save(5, &f32_state(2, 100, 5))
        .await
        .unwrap()
        .wait()
        .await
        .unwrap();
    let steps = committed_steps(&cp).await.unwrap();
    assert_eq!(
        steps,
        vec![3, 5],
        "a failed persist never becomes a checkpoint"
    );
}
