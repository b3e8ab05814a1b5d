//! The two-phase engine: concurrent saves under the staging budget, the busy
//! policy, lazy snapshots, incremental reuse with retention, load into buffers.

use std::sync::Arc;

use ckpt_core::{Capture, DType, SharedVec, SnapshotMode};
use ckpt_tests::*;

fn contents(v: &SharedVec) -> Vec<u8> {
    v.0.read().unwrap().clone()
}

/// A checkpointer of a fresh in-memory root, snapshotting in `mode`.
async fn in_memory(tag: &str, mode: SnapshotMode) -> ckpt_core::Checkpointer {
    ckpt_formats::builder(memory_root(tag))
        .snapshot(mode)
        .build()
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eager_snapshot_copies_then_the_loop_may_mutate() {
    let url = memory_root("eager");
    let cp = ckpt_formats::builder(&url).build().await.unwrap();
    let (vecs, cap) = mutable_state(3, 10_000, 1);
    let before: Vec<Vec<u8>> = vecs.iter().map(|v| contents(v)).collect();
    let h = cp.save(1, cap).await.unwrap();
    assert!(h.snapshot_done(), "eager save returns after the copy");
    // The training loop mutates right away: the checkpoint must hold the old values.
    for v in &vecs {
        v.0.write()
            .unwrap()
            .iter_mut()
            .for_each(|b| *b = b.wrapping_add(1));
    }
    let report = h.wait().await.unwrap();
    assert_eq!(report.copied_bytes, 3 * 40_000);
    let loaded = cp.load_latest().await.unwrap().unwrap();
    for (t, b) in loaded.state.tensors.iter().zip(&before) {
        assert_eq!(&t.data[..], &b[..]);
    }
}

/// An eager save made with `save_shared` hands back its snapshot's tensors;
/// another checkpointer saves the same snapshot from them without a copy, and
/// both hold the values at the save although the loop mutates right after.
/// A lazy save has nothing to hand back yet.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shared_eager_snapshot_is_saved_by_a_second_checkpointer_without_a_copy() {
    let first = in_memory("shared-a", SnapshotMode::Eager).await;
    let second = in_memory("shared-b", SnapshotMode::Eager).await;
    let (vecs, cap) = mutable_state(3, 10_000, 1);
    let before: Vec<Vec<u8>> = vecs.iter().map(|v| contents(v)).collect();
    let (h, taken) = first.save_shared(1, cap).await.unwrap();
    let taken = taken.expect("an eager save hands back its snapshot");
    for v in &vecs {
        v.0.write()
            .unwrap()
            .iter_mut()
            .for_each(|b| *b = b.wrapping_add(1));
    }
    let again = Capture::from(ckpt_core::State {
        tensors: taken,
        meta: Default::default(),
    });
    let h2 = second.save(1, again).await.unwrap();
    assert_eq!(h.wait().await.unwrap().copied_bytes, 3 * 40_000);
    assert_eq!(h2.wait().await.unwrap().copied_bytes, 0);
    for cp in [&first, &second] {
        let loaded = cp.load_latest().await.unwrap().unwrap();
        for (t, b) in loaded.state.tensors.iter().zip(&before) {
            assert_eq!(&t.data[..], &b[..]);
        }
    }

    let lazy = in_memory("shared-lazy", SnapshotMode::Lazy).await;
    let (_, cap) = mutable_state(1, 100, 2);
    let (h, taken) = lazy.save_shared(1, cap).await.unwrap();
    assert!(taken.is_none());
    h.wait().await.unwrap();
}

/// A source given for two tensors (a tied weight) is staged once, in both
/// snapshot modes, and both tensors load back with its bytes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_source_shared_by_two_tensors_is_copied_once() {
    let cases = [
        (SnapshotMode::Eager, 8 << 20, "tied-eager"),
        (SnapshotMode::Lazy, 8 << 20, "tied-lazy"),
        // Split into chunks: the tied tensors' chunks are the same memory,
        // written once, and each tensor's record points at them.
        (SnapshotMode::Eager, 1000, "tied-split"),
    ];
    for (mode, chunk_size, tag) in cases {
        let mut opts = ckpt_core::CheckpointerOptions::default();
        opts.write.chunk_size = chunk_size;
        let cp = ckpt_formats::builder(memory_root(tag))
            .options(opts)
            .snapshot(mode)
            .build()
            .await
            .unwrap();
        let tied = SharedVec::new((0..4000u32).map(|i| (i * 7) as u8).collect());
        let other = SharedVec::new(vec![9u8; 400]);
        let cap = Capture::default()
            .with_copy("wte", DType::U8, vec![4000], tied.clone())
            .with_copy("ln", DType::U8, vec![400], other.clone())
            .with_copy("lm_head", DType::U8, vec![4000], tied.clone());
        let h = cp.save(1, cap).await.unwrap();
        h.wait_snapshot().await.unwrap();
        tied.0.write().unwrap().fill(0); // the loop goes on after the snapshot
        let report = h.wait().await.unwrap();
        assert_eq!(
            report.copied_bytes, 4400,
            "{tag}: the tied source counts once"
        );
        assert_eq!(report.raw_bytes, 8400, "{tag}");
        if chunk_size == 1000 {
            // (Small tensors share packs, which hold the bytes of each member.)
            assert_eq!(
                report.reused_bytes, 4000,
                "{tag}: lm_head reuses wte's chunks"
            );
            assert!(report.stored_bytes < 4400 + 5 * 64, "{tag}: {report:?}");
        }
        let loaded = cp.load_latest().await.unwrap().unwrap();
        let want: Vec<u8> = (0..4000u32).map(|i| (i * 7) as u8).collect();
        let by_name = |n: &str| {
            loaded
                .state
                .tensors
                .iter()
                .find(|t| t.name == n)
                .unwrap_or_else(|| panic!("{tag}: {n} is missing"))
                .data
                .clone()
        };
        assert_eq!(&by_name("wte")[..], &want[..], "{tag}");
        assert_eq!(&by_name("lm_head")[..], &want[..], "{tag}");
        assert_eq!(&by_name("ln")[..], &[9u8; 400][..], "{tag}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lazy_snapshot_returns_before_the_copy_and_records_pre_mutation_values() {
    let url = memory_root("lazy");
    let cp = ckpt_formats::builder(&url)
        .snapshot(SnapshotMode::Lazy)
        .build()
        .await
        .unwrap();
    let (vecs, cap) = mutable_state(8, 200_000, 7);
    let before: Vec<Vec<u8>> = vecs.iter().map(|v| contents(v)).collect();
    let h = cp.save(1, cap).await.unwrap();
    // The contract: wait for the snapshot before mutating (the optimizer step).
    h.wait_snapshot().await.unwrap();
    assert!(h.snapshot_done());
    for v in &vecs {
        v.0.write().unwrap().fill(0);
    }
    h.wait().await.unwrap();
    let loaded = cp.load_latest().await.unwrap().unwrap();
    for (t, b) in loaded.state.tensors.iter().zip(&before) {
        assert_eq!(&t.data[..], &b[..], "{}", t.name);
    }
}

#[cfg(debug_assertions)]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn debug_builds_catch_a_mutation_during_a_lazy_snapshot() {
    // A source that changes every time it is read stands for a tensor the optimizer
    // updates while the snapshot is copying it.
    struct Moving(std::sync::atomic::AtomicU8);
    impl ckpt_core::CopySource for Moving {
        fn len(&self) -> usize {
            16
        }
        fn copy_into(&self, dst: &mut [u8]) -> ckpt_core::Result<()> {
            dst.fill(self.0.fetch_add(1, std::sync::atomic::Ordering::SeqCst));
            Ok(())
        }
    }
    let cp = in_memory("moving", SnapshotMode::Lazy).await;
    let cap = Capture::default().with_copy("w", DType::F32, vec![4], Arc::new(Moving(0.into())));
    let h = cp.save(1, cap).await.unwrap();
    // The snapshot's own error comes back, with its type.
    assert!(matches!(
        h.wait_snapshot().await,
        Err(ckpt_core::Error::InvalidInput(_))
    ));
    assert!(h.wait().await.is_err());
    assert!(cp.load_latest().await.unwrap().is_none());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_saves_stay_within_the_budget_and_all_commit() {
    let url = memory_root("concurrent");
    let budget = 3 * 4 * 100_000 * 2; // two saves' worth of staging
    let cp = ckpt_formats::builder(&url)
        .staging_budget(budget as u64)
        .build()
        .await
        .unwrap();
    let mut handles = Vec::new();
    let mut expected = Vec::new();
    for step in 1..=6u64 {
        let (vecs, cap) = mutable_state(3, 100_000, step * 10);
        expected.push(vecs.iter().map(|v| contents(v)).collect::<Vec<_>>());
        handles.push(cp.save(step, cap).await.unwrap());
        let pool = cp.staging().unwrap();
        assert!(pool.idle_bytes() <= budget as u64);
    }
    for h in handles {
        h.wait().await.unwrap();
    }
    assert_eq!(cp.committed().await.unwrap().len(), 6);
    for (i, want) in expected.iter().enumerate() {
        let loaded = cp.load_step(i as u64 + 1).await.unwrap();
        for (t, b) in loaded.state.tensors.iter().zip(want) {
            assert_eq!(&t.data[..], &b[..]);
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_default_staging_budget_grows_with_the_state() {
    // A first save before the optimizer has state is small; later ones are bigger.
    let cp = in_memory("grow", SnapshotMode::Eager).await;
    let (_small, cap) = mutable_state(1, 1000, 1);
    cp.save(1, cap).await.unwrap().wait().await.unwrap();
    let first_budget = cp.staging().unwrap().budget();
    let (_big, cap) = mutable_state(4, 5_000_000, 2); // 80 MB, more than the first budget
    cp.save(2, cap).await.unwrap().wait().await.unwrap();
    assert!(cp.staging().unwrap().budget() > first_budget);
    // A budget the user set is a limit, not a hint.
    let fixed = ckpt_formats::builder(memory_root("fixed"))
        .staging_budget(1 << 20)
        .build()
        .await
        .unwrap();
    let (_big, cap) = mutable_state(1, 1_000_000, 3);
    assert!(matches!(
        fixed.save(1, cap).await,
        Err(ckpt_core::Error::InvalidInput(_))
    ));
}
