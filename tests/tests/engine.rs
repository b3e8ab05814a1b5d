//! The two-phase engine: concurrent saves under the staging budget, the busy
//! policy, lazy snapshots, incremental reuse with retention, load into buffers.

use std::sync::Arc;

use ckpt_core::{Capture, DType, SharedSnapshot, SharedVec, SnapshotMode};
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
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shared_eager_snapshot_is_saved_by_a_second_checkpointer_without_a_copy() {
    let first = in_memory("shared-a", SnapshotMode::Eager).await;
    let second = in_memory("shared-b", SnapshotMode::Eager).await;
    let (vecs, cap) = mutable_state(3, 10_000, 1);
    let before: Vec<Vec<u8>> = vecs.iter().map(|v| contents(v)).collect();
    let (h, shared) = first.save_shared(1, cap).await.unwrap();
    let SharedSnapshot::Taken(taken) = shared else {
        panic!("an eager save hands back its snapshot taken");
    };
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
}

/// A lazy save made with `save_shared` hands back its snapshot for later:
/// another checkpointer's `save_snapshot` returns at once, copies nothing,
/// its snapshot is done once the first's is, and both hold the values at
/// the save although the loop mutates right after the first's snapshot.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shared_lazy_snapshot_is_saved_by_a_second_checkpointer_once_taken() {
    let first = in_memory("shared-lazy-a", SnapshotMode::Lazy).await;
    let second = in_memory("shared-lazy-b", SnapshotMode::Lazy).await;
    let (vecs, cap) = mutable_state(3, 10_000, 7);
    let before: Vec<Vec<u8>> = vecs.iter().map(|v| contents(v)).collect();
    let (gate, open) = gate();
    let cap = Capture {
        ready: Some(Arc::new(gate)),
        ..cap
    };
    let (h, shared) = first.save_shared(1, cap).await.unwrap();
    let SharedSnapshot::Later(later) = shared else {
        panic!("a lazy save hands back its snapshot for later");
    };
    assert!(!later.is_ready());
    let meta = ckpt_core::Value::Str("durable".into());
    let h2 = second.save_snapshot(1, meta, later).await.unwrap();
    assert!(
        !h.snapshot_done() && !h2.snapshot_done(),
        "both wait for the first's copy"
    );
    open.send(Ok(())).unwrap();
    h.wait_snapshot().await.unwrap();
    h2.wait_snapshot().await.unwrap();
    for v in &vecs {
        v.0.write()
            .unwrap()
            .iter_mut()
            .for_each(|b| *b = b.wrapping_add(1));
    }
    assert_eq!(h.wait().await.unwrap().copied_bytes, 3 * 40_000);
    assert_eq!(h2.wait().await.unwrap().copied_bytes, 0);
    for cp in [&first, &second] {
        let loaded = cp.load_latest().await.unwrap().unwrap();
        for (t, b) in loaded.state.tensors.iter().zip(&before) {
            assert_eq!(&t.data[..], &b[..]);
        }
    }
    let loaded = second.load_latest().await.unwrap().unwrap();
    assert_eq!(loaded.state.meta, ckpt_core::Value::Str("durable".into()));
}

/// A shared lazy snapshot that fails fails the save that shares it too, with
/// its error, and neither commits; the second checkpointer saves on after it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_shared_lazy_snapshot_fails_both_saves() {
    let first = in_memory("shared-fail-a", SnapshotMode::Lazy).await;
    let second = in_memory("shared-fail-b", SnapshotMode::Lazy).await;
    let (_, cap) = mutable_state(2, 1_000, 3);
    let (gate, open) = gate();
    let cap = Capture {
        ready: Some(Arc::new(gate)),
        ..cap
    };
    let (h, shared) = first.save_shared(1, cap).await.unwrap();
    let SharedSnapshot::Later(later) = shared else {
        panic!("a lazy save hands back its snapshot for later");
    };
    let h2 = second
        .save_snapshot(1, Default::default(), later)
        .await
        .unwrap();
    open.send(Err("the device copy failed".into())).unwrap();
    for h in [h, h2] {
        let e = h.wait().await.unwrap_err();
        assert!(
            matches!(e, ckpt_core::Error::InvalidInput(ref m) if m.contains("device copy failed")),
            "{e}"
        );
    }
    assert!(second.load_latest().await.unwrap().is_none());
    let (_, cap) = mutable_state(1, 100, 4);
    let h = second.save(2, cap).await;
    // The failure was seen through the handle; the next save goes on.
    h.unwrap().wait().await.unwrap();
    assert_eq!(second.load_latest().await.unwrap().unwrap().id.step, 2);
}

/// A gate the snapshot waits on before it reads (a device's copy-done
/// event), and the sender that opens it or fails it.
#[derive(Debug)]
struct Gate(std::sync::Mutex<std::sync::mpsc::Receiver<Result<(), String>>>);

impl ckpt_core::Ready for Gate {
    fn wait(&self) -> ckpt_core::Result<()> {
        match self.0.lock().unwrap().recv() {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => Err(ckpt_core::Error::InvalidInput(e)),
            Err(_) => Err(ckpt_core::Error::Internal("opener vanished".into())),
        }
    }
}

fn gate() -> (Gate, std::sync::mpsc::Sender<Result<(), String>>) {
    let (tx, rx) = std::sync::mpsc::channel();
    (Gate(std::sync::Mutex::new(rx)), tx)
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
            // Once each: 4,400 bytes in 5 chunks, each with its header.
            let header = ckpt_formats::native::chunk::HEADER_LEN as u64;
            assert!(
                report.stored_bytes <= 4400 + 5 * header,
                "{tag}: {report:?}"
            );
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

/// In lazy mode a `CopyNow` tensor is copied before `save` returns (the
/// loop may change it at once), the `Copy` ones in the background behind the
/// gate; a source given as `CopyNow` for one tensor and `Copy` for another
/// is copied once, now. Both kinds go through staging, and all hold the
/// values at the save.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lazy_copy_now_tensors_are_copied_in_the_stall_the_rest_behind_the_gate() {
    let cp = in_memory("copy-now", SnapshotMode::Lazy).await;
    let (vecs, _) = mutable_state(4, 5_000, 11);
    let before: Vec<Vec<u8>> = vecs.iter().map(|v| contents(v)).collect();
    let src = |i: usize| vecs[i].clone() as Arc<dyn ckpt_core::CopySource>;
    let (gate, open) = gate();
    let mut cap = Capture::default()
        .with_copy("later", DType::F32, vec![5_000], src(0))
        .with_copy("tied_later", DType::F32, vec![5_000], src(1));
    for (name, i) in [("now", 2), ("tied_now", 1), ("also_now", 3)] {
        cap.tensors.push(ckpt_core::SourceTensor {
            name: name.into(),
            dtype: DType::F32,
            shape: vec![5_000],
            shard: None,
            data: ckpt_core::TensorData::CopyNow(src(i)),
        });
    }
    cap.ready = Some(Arc::new(gate));
    let h = cp.save(1, cap).await.unwrap();
    assert!(!h.snapshot_done(), "the Copy tensors wait behind the gate");
    // The loop changes what it did not guard right away.
    for i in [1, 2, 3] {
        vecs[i].0.write().unwrap().fill(0);
    }
    open.send(Ok(())).unwrap();
    let report = h.wait().await.unwrap();
    assert_eq!(
        report.copied_bytes,
        4 * 20_000,
        "four sources, each copied once"
    );
    let loaded = cp.load_latest().await.unwrap().unwrap();
    let by_name = |n: &str| {
        loaded
            .state
            .tensors
            .iter()
            .find(|t| t.name == n)
            .unwrap()
            .data
            .to_vec()
    };
    for (name, i) in [
        ("later", 0),
        ("tied_later", 1),
        ("now", 2),
        ("tied_now", 1),
        ("also_now", 3),
    ] {
        assert_eq!(by_name(name), before[i], "{name}");
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
    // Each staging buffer is whole pages: 20,000 tensors of 1 KiB need 80 MiB
    // of staging for 20 MiB of bytes, more than twice their bytes (and than the
    // 64 MiB floor). The default budget counts pages, so such a state saves.
    let many = in_memory("many-small", SnapshotMode::Eager).await;
    let (vecs, cap) = mutable_state(20_000, 256, 3);
    many.save(1, cap).await.unwrap().wait().await.unwrap();
    assert!(many.staging().unwrap().budget() >= 20_000 * 4096);
    let loaded = many.load_step(1).await.unwrap();
    assert_eq!(loaded.state.tensors.len(), 20_000);
    for (t, v) in loaded.state.tensors.iter().zip(&vecs).step_by(997) {
        assert_eq!(&t.data[..], &contents(v)[..]);
    }
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
