//! Save and load round trips through every backend of the foundation:
//! every dtype, empty and 0-d tensors, tensors spanning many chunks, non-tensor state.

use ckpt_core::{CheckpointerOptions, Compression, DType, State};
use ckpt_tests::*;
use proptest::prelude::*;

async fn round_trip(url: &str, state: &State, compression: Compression) {
    let mut opts = CheckpointerOptions::default();
    opts.write.chunk_size = 1000; // many chunks, and chunk boundaries inside elements
    opts.write.compression = compression;
    let cp = ckpt_formats::builder(url)
        .options(opts)
        .build()
        .await
        .unwrap();
    let report = cp.save(5, state).await.unwrap().wait().await.unwrap();
    assert_eq!(report.raw_bytes, state.nbytes());
    // A fresh checkpointer (as after a restart) sees the same.
    let cp2 = ckpt_formats::builder(url).build().await.unwrap();
    let loaded = cp2.load_latest().await.unwrap().expect("a checkpoint");
    assert_eq!(loaded.id.step, 5);
    assert!(loaded.skipped.is_empty());
    assert_same(state, &loaded.state);
}

#[tokio::test]
async fn every_dtype_file_and_memory() {
    let state = every_dtype_state(1);
    let (_dir, url) = temp_root();
    round_trip(&url, &state, Compression::None).await;
    round_trip(&memory_root("dtypes"), &state, Compression::None).await;
    round_trip(&memory_root("dtypes-z"), &state, Compression::Zstd(3)).await;
}

#[tokio::test]
async fn large_tensor_spans_many_chunks() {
    let big = tensor("big", DType::F32, &[3, 1000, 333], 9); // ~4 MB, not a multiple of the chunk size
    let state = State::new()
        .with_tensor(big)
        .with_tensor(tensor("tail", DType::U8, &[1], 2));
    let (dir, url) = temp_root();
    let mut opts = CheckpointerOptions::default();
    opts.write.chunk_size = 64 << 10;
    let cp = ckpt_formats::builder(&url)
        .options(opts)
        .build()
        .await
        .unwrap();
    let h = cp.save(1, &state).await.unwrap();
    h.wait().await.unwrap();
    let m = cp
        .manifest(&cp.committed().await.unwrap()[0])
        .await
        .unwrap();
    match &m.tensors[0].layout {
        ckpt_core::Layout::Chunks { chunks } => {
            assert_eq!(chunks.len(), (3 * 1000 * 333 * 4usize).div_ceil(64 << 10))
        }
        other => panic!("unexpected layout {other:?}"),
    }
    let chunk_files = std::fs::read_dir(dir.path().join("chunks"))
        .unwrap()
        .count();
    assert!(
        chunk_files > 60,
        "chunks are separate objects: {chunk_files}"
    );
    assert_same(&state, &cp.load_latest().await.unwrap().unwrap().state);
    // Random access: one tensor alone.
    let id = cp.committed().await.unwrap()[0].clone();
    let only = cp.load_tensors(&id, &["tail"]).await.unwrap();
    assert_eq!(only[0].data, state.tensors[1].data);
}

#[tokio::test]
async fn compression_shrinks_compressible_state() {
    let zeros = ckpt_core::Tensor::new("z", DType::F32, vec![1 << 18], vec![0u8; 1 << 20]).unwrap();
    let state = State::new().with_tensor(zeros);
    let url = memory_root("zstd");
    let cp = ckpt_formats::builder(&url)
        .compression(Compression::Zstd(3))
        .build()
        .await
        .unwrap();
    let r = cp.save(1, &state).await.unwrap().wait().await.unwrap();
    assert!(
        r.stored_bytes < r.raw_bytes / 50,
        "{} vs {}",
        r.stored_bytes,
        r.raw_bytes
    );
    assert_same(&state, &cp.load_latest().await.unwrap().unwrap().state);
}

#[tokio::test]
async fn empty_store_and_bad_input() {
    let cp = ckpt_formats::builder(memory_root("empty"))
        .build()
        .await
        .unwrap();
    assert!(cp.load_latest().await.unwrap().is_none());
    assert!(matches!(
        cp.load_step(3).await,
        Err(ckpt_core::Error::NotFound { .. })
    ));
    let dup = State::new()
        .with_tensor(tensor("a", DType::U8, &[1], 1))
        .with_tensor(tensor("a", DType::U8, &[1], 2));
    assert!(matches!(
        cp.save(1, &dup).await,
        Err(ckpt_core::Error::InvalidInput(_))
    ));
    // A step that is already committed is a conflict, and the stored one is untouched.
    let s = f32_state(1, 16, 3);
    cp.save(2, &s).await.unwrap().wait().await.unwrap();
    assert!(matches!(
        cp.save(2, &f32_state(1, 16, 4)).await,
        Err(ckpt_core::Error::Conflict(_))
    ));
    assert_same(&s, &cp.load_step(2).await.unwrap().state);
    assert!(ckpt_formats::builder("gopher://x").build().await.is_err());
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]
    #[test]
    fn random_states_round_trip(
        shapes in proptest::collection::vec((0usize..DType::ALL.len(), proptest::collection::vec(0u64..6, 0..4), any::<u64>()), 1..6),
        chunk in 1usize..300,
        z in any::<bool>(),
    ) {
        let mut state = State::new();
        for (i, (d, shape, seed)) in shapes.into_iter().enumerate() {
            let dtype = DType::ALL[d];
            let mut shape = shape;
            // sub-byte dtypes need whole bytes
            if dtype.byte_len(shape.iter().product()).is_err() { shape = vec![4]; }
            state = state.with_tensor(tensor(&format!("t{i}"), dtype, &shape, seed));
        }
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        rt.block_on(async {
            let mut opts = CheckpointerOptions::default();
            opts.write.chunk_size = chunk;
            opts.write.compression = if z { Compression::Zstd(1) } else { Compression::None };
            let cp = ckpt_formats::builder(memory_root("prop")).options(opts).build().await.unwrap();
            cp.save(1, &state).await.unwrap().wait().await.unwrap();
            assert_same(&state, &cp.load_latest().await.unwrap().unwrap().state);
        });
    }
}

#[tokio::test]
async fn small_tensors_are_packed_and_each_shared_chunk_is_read_once() {
    use ckpt_core::store::CountingStore;
    use std::sync::Arc;
    // 300 tensors of 1 KiB and one of 1 MiB, 256 KiB chunks: the small ones share
    // two chunks instead of being 300 objects.
    let mut state = f32_state(300, 256, 7);
    state = state.with_tensor(tensor("big", DType::F32, &[1 << 18], 1));
    let counting = Arc::new(CountingStore::new(ckpt_core::store::memory_store(
        &memory_root("pack"),
    )));
    let mut opts = CheckpointerOptions::default();
    opts.write.chunk_size = 256 << 10;
    let cp = ckpt_formats::builder("memory://unused")
        .store(counting.clone())
        .options(opts)
        .build()
        .await
        .unwrap();
    let r = cp.save(1, &state).await.unwrap().wait().await.unwrap();
    assert_eq!(
        r.objects,
        2 + 4 + 1,
        "2 packs, 4 pieces of the big tensor, the manifest"
    );
    let before = counting.counts();
    let loaded = cp.load_latest().await.unwrap().unwrap();
    assert_same(&state, &loaded.state);
    let gets = counting.counts().gets - before.gets;
    assert_eq!(
        gets,
        1 + 1 + 2 + 4,
        "the newest epoch claim, the manifest, each pack once, each piece once"
    );
    // One small tensor alone reads one pack.
    let before = counting.counts();
    let one = cp
        .load_tensors(&loaded.id, &["layer150.weight"])
        .await
        .unwrap();
    assert_eq!(one[0].data, state.tensors[150].data);
    assert_eq!(counting.counts().gets - before.gets, 2);
    // A damaged pack is reported for the tensor that reads it, and load_into works on packs.
    let mut buf = vec![0u8; 1024];
    cp.load_into(&loaded.id, vec![("layer3.weight", &mut buf[..])])
        .await
        .unwrap();
    assert_eq!(&buf[..], &state.tensors[3].data[..]);
}
