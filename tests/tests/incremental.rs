//! Incremental checkpoints: unchanged chunks are not written again, and retention
//! with GC never deletes a chunk that a kept checkpoint uses.

use std::sync::Arc;

use ckpt_core::{CheckpointerOptions, DType, Retention, State, Tensor};
use ckpt_tests::*;

fn change(state: &State, which: &[usize], seed: u64) -> State {
    let mut s = state.clone();
    for &i in which {
        let t = &s.tensors[i];
        s.tensors[i] = Tensor::new(
            t.name.clone(),
            t.dtype,
            t.shape.clone(),
            bytes_for(seed + i as u64, t.data.len()),
        )
        .unwrap();
    }
    s
}

#[tokio::test]
async fn second_checkpoint_writes_only_changed_chunks() {
    let url = memory_root("incr");
    let mut opts = CheckpointerOptions::default();
    opts.write.chunk_size = 16 << 10;
    let cp = ckpt_formats::builder(&url)
        .options(opts.clone())
        .build()
        .await
        .unwrap();
    let s1 = f32_state(20, 16 << 10, 1); // 20 tensors of 64 KiB
    let r1 = cp.save(1, &s1).await.unwrap().wait().await.unwrap();
    assert_eq!(r1.reused_bytes, 0);
    let s2 = change(&s1, &[3, 11], 99); // 10% of tensors change
    let r2 = cp.save(2, &s2).await.unwrap().wait().await.unwrap();
    assert_eq!(r2.reused_bytes, 18 * (64 << 10));
    assert!(
        r2.stored_bytes * 100 <= r1.stored_bytes * 12,
        "{} vs {}",
        r2.stored_bytes,
        r1.stored_bytes
    );
    assert_same(&s2, &cp.load_step(2).await.unwrap().state);
    assert_same(&s1, &cp.load_step(1).await.unwrap().state);

    // A restarted job learns the stored chunks from the newest checkpoint at
    // its first save, not by listing them at open, and still reuses them.
    // (With the same chunk size: chunks are cut, and small tensors packed, by it.)
    let cp2 = ckpt_formats::builder(&url)
        .options(opts)
        .build()
        .await
        .unwrap();
    assert_eq!(cp2.known_chunks(), 0);
    let r3 = cp2
        .save(3, &change(&s2, &[0], 777))
        .await
        .unwrap()
        .wait()
        .await
        .unwrap();
    assert_eq!(r3.reused_bytes, 19 * (64 << 10));
}

#[tokio::test]
async fn retention_and_gc_keep_every_needed_chunk() {
    let (dir, url) = temp_root();
    let mut opts = CheckpointerOptions::default();
    opts.write.chunk_size = 8 << 10;
    opts.retention = Retention {
        keep_last: Some(2),
        keep_every: Some(4),
    };
    // No other process writes here: unreferenced chunks go at once.
    opts.gc_grace = std::time::Duration::ZERO;
    let cp = ckpt_formats::builder(&url)
        .options(opts)
        .build()
        .await
        .unwrap();
    // A frozen tensor shared by every checkpoint, and one that changes each step.
    let frozen = tensor("frozen", DType::F32, &[8 << 10], 5);
    let mut states = Vec::new();
    for step in 1..=9u64 {
        let s = State::new().with_tensor(frozen.clone()).with_tensor(tensor(
            "moving",
            DType::F32,
            &[4 << 10],
            100 + step,
        ));
        cp.save(step, &s).await.unwrap().wait().await.unwrap();
        states.push(s);
    }
    cp.flush().await;
    let kept = committed_steps(&cp).await.unwrap();
    assert_eq!(kept, vec![4, 8, 9]);
    for step in &kept {
        let loaded = cp.load_step(*step).await.unwrap();
        assert_same(&states[*step as usize - 1], &loaded.state);
        cp.verify(&loaded.id).await.unwrap();
    }
    // The chunks of retired checkpoints are gone: 4 frozen + 2 moving chunks per kept step.
    let chunk_files = std::fs::read_dir(dir.path().join("chunks"))
        .unwrap()
        .count();
    assert_eq!(chunk_files, 4 + 2 * kept.len());
    assert!(cp
        .list(true)
        .await
        .unwrap()
        .iter()
        .all(|c| c.status == ckpt_core::Status::Committed));
}

#[tokio::test]
async fn gc_removes_incomplete_saves() {
    let url = memory_root("gc-incomplete");
    // The leftovers below are made now: collect them without a grace period,
    // with a full sweep (which finds incomplete saves) after every commit.
    let opts = CheckpointerOptions {
        retention: Retention::keep_last(3),
        gc_grace: std::time::Duration::ZERO,
        gc_sweep_every: 1,
        ..Default::default()
    };
    let cp = ckpt_formats::builder(&url)
        .options(opts)
        .build()
        .await
        .unwrap();
    // An incomplete save: data written, no manifest (a format that writes data/ objects
    // is needed for a data dir; emulate the crash leftovers directly).
    let store = cp.store().clone();
    let orphan = ckpt_core::CheckpointId {
        step: 1,
        attempt: "dead".into(),
    };
    use object_store::ObjectStoreExt;
    store
        .put(
            &ckpt_core::layout::data_prefix(&orphan)
                .clone()
                .join("rank0.bin"),
            vec![1u8; 10].into(),
        )
        .await
        .unwrap();
    let listed = cp.list(false).await.unwrap();
    assert_eq!(listed.len(), 1);
    assert_eq!(listed[0].status, ckpt_core::Status::Incomplete);
    cp.save(2, &f32_state(1, 10, 1))
        .await
        .unwrap()
        .wait()
        .await
        .unwrap();
    let listed = cp.list(false).await.unwrap();
    assert_eq!(listed.len(), 1, "{listed:?}");
    assert_eq!(listed[0].id.step, 2);
}

#[tokio::test]
async fn load_into_given_buffers() {
    let url = memory_root("into");
    let mut opts = CheckpointerOptions::default();
    opts.write.chunk_size = 1000;
    opts.write.compression = ckpt_core::Compression::Zstd(1);
    let cp = ckpt_formats::builder(&url)
        .options(opts)
        .build()
        .await
        .unwrap();
    let s = f32_state(3, 5000, 4);
    cp.save(1, &s).await.unwrap().wait().await.unwrap();
    let id = cp.committed().await.unwrap()[0].clone();
    let mut a = vec![0u8; 20_000];
    let mut c = vec![0u8; 20_000];
    cp.load_into(
        &id,
        vec![("layer0.weight", &mut a[..]), ("layer2.weight", &mut c[..])],
    )
    .await
    .unwrap();
    assert_eq!(&a[..], &s.tensors[0].data[..]);
    assert_eq!(&c[..], &s.tensors[2].data[..]);
    let mut short = [0u8; 10];
    assert!(matches!(
        cp.load_into(&id, vec![("layer1.weight", &mut short[..])])
            .await,
        Err(ckpt_core::Error::InvalidInput(_))
    ));
    assert!(matches!(
        cp.load_into(&id, vec![("nope", &mut short[..])]).await,
        Err(ckpt_core::Error::NotFound { .. })
    ));
}

/// Opening lists nothing, and a commit's GC lists the same whatever is
/// stored: `manifests/`, the epochs and each retired checkpoint's own
/// `data/` prefix, not `chunks/` or all of `data/` (that is the periodic
/// full sweep's). What it retires, it still deletes.
#[tokio::test]
async fn gc_after_a_commit_lists_what_it_retires_not_what_is_stored() {
    let store = Arc::new(ckpt_core::store::CountingStore::new(
        ckpt_core::store::open_url(&memory_root("gc-lists")).unwrap(),
    ));
    let mut opts = CheckpointerOptions::default();
    opts.write.chunk_size = 8 << 10;
    // Odd steps go, even ones stay: the store grows with every save.
    opts.retention = Retention {
        keep_last: Some(1),
        keep_every: Some(2),
    };
    opts.gc_grace = std::time::Duration::ZERO;
    opts.gc_sweep_every = 1000;
    let cp = ckpt_formats::builder("memory://gc-lists")
        .store(store.clone())
        .options(opts)
        .build()
        .await
        .unwrap();
    assert_eq!(store.counts().lists, 0, "opening listed the store");
    let mut lists = Vec::new();
    for step in 1..=12u64 {
        let before = store.counts().lists;
        let r = cp
            .save(step, &f32_state(4, 4 << 10, step * 100))
            .await
            .unwrap()
            .wait()
            .await
            .unwrap();
        lists.push(store.counts().lists - before);
        if step % 2 == 0 {
            // Step - 1 (odd) was retired now, with the chunks only it had.
            let gc = r.gc.unwrap();
            assert_eq!(gc.retired.len(), 1, "{gc:?}");
            assert!(gc.chunks_deleted > 0, "{gc:?}");
        }
    }
    // The first GC is a full sweep; after it, commits that retire one
    // checkpoint (even steps) list alike, and so do those that retire none,
    // however many checkpoints are stored by then.
    for i in 4..lists.len() {
        assert_eq!(lists[i], lists[i - 2], "list requests per save: {lists:?}");
    }
    for step in (2..=12).step_by(2) {
        let got = cp.load_step(step).await.unwrap();
        assert_same(&f32_state(4, 4 << 10, step * 100), &got.state);
    }
    // A full sweep on request finds nothing more to delete.
    let full = cp.gc().await.unwrap();
    assert_eq!(full.chunks_deleted, 0, "{full:?}");
}
