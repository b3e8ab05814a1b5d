//! Loading boxes of whole and sharded tensors straight into caller buffers
//! (`Checkpointer::load_boxes_into`): any split of the global tensor, only the
//! overlapping pieces read, and every target checked before anything is written.

use bytes::Bytes;
use ckpt_core::BoxTarget;
use ckpt_core::{DType, Error, ShardSpec, State, Tensor};
use ckpt_tests::*;

/// A 7x5 f32 tensor saved as two uneven pieces (rows 0..4 and 4..7) under one
/// name, and a whole 3-element tensor: what one rank of a DTensor job whose
/// shard is not one box would hand over, or two ranks' shards together.
fn state() -> (State, Vec<u8>) {
    let full = bytes_for(11, 7 * 5 * 4);
    let piece = |lo: u64, hi: u64| {
        let mut t = Tensor::new(
            "w",
            DType::F32,
            vec![hi - lo, 5],
            Bytes::copy_from_slice(&full[(lo * 20) as usize..(hi * 20) as usize]),
        )
        .unwrap();
        t.shard = Some(ShardSpec {
            global_shape: vec![7, 5],
            offsets: vec![lo, 0],
        });
        t
    };
    let s = State::new()
        .with_tensor(piece(0, 4))
        .with_tensor(piece(4, 7))
        .with_tensor(tensor("b", DType::F32, &[3], 3));
    (s, full)
}

fn target<'a>(
    name: &'a str,
    shape: &[u64],
    offsets: &[u64],
    global: &[u64],
    dst: &'a mut [u8],
) -> BoxTarget<'a> {
    BoxTarget {
        name,
        dtype: Some(DType::F32),
        shape: shape.to_vec(),
        spec: ShardSpec {
            global_shape: global.to_vec(),
            offsets: offsets.to_vec(),
        },
        dst,
    }
}

#[tokio::test]
async fn boxes_of_any_split_fill_caller_buffers() {
    let (state, full) = state();
    let (_dir, url) = temp_root();
    let cp = ckpt_formats::builder(&url).build().await.unwrap();
    cp.save(1, &state).await.unwrap().wait().await.unwrap();
    let id = cp.committed().await.unwrap()[0].clone();

    // Three ranks' rows (3, 2, 2), across the stored pieces' boundary, and a column box.
    let (mut a, mut b, mut c) = (vec![0u8; 60], vec![0u8; 40], vec![0u8; 40]);
    let mut col = vec![0u8; 7 * 2 * 4];
    let mut whole_b = vec![0u8; 12];
    cp.load_boxes_into(
        &id,
        vec![
            target("w", &[3, 5], &[0, 0], &[7, 5], &mut a),
            target("w", &[2, 5], &[3, 0], &[7, 5], &mut b),
            target("w", &[2, 5], &[5, 0], &[7, 5], &mut c),
            target("w", &[7, 2], &[0, 3], &[7, 5], &mut col),
            target("b", &[3], &[0], &[3], &mut whole_b),
        ],
    )
    .await
    .unwrap();
    assert_eq!(a, full[..60]);
    assert_eq!(b, full[60..100]);
    assert_eq!(c, full[100..140]);
    let want_col: Vec<u8> = (0..7)
        .flat_map(|r| full[r * 20 + 12..r * 20 + 20].to_vec())
        .collect();
    assert_eq!(col, want_col);
    assert_eq!(whole_b, state.tensors[2].data[..]);
}

#[tokio::test]
async fn a_bad_target_fails_before_any_buffer_is_written() {
    let (state, _) = state();
    let (_dir, url) = temp_root();
    let cp = ckpt_formats::builder(&url).build().await.unwrap();
    cp.save(1, &state).await.unwrap().wait().await.unwrap();
    let id = cp.committed().await.unwrap()[0].clone();
    // (shape, offsets, global shape, dtype) of a target for `w`.
    type Case = (Vec<u64>, Vec<u64>, Vec<u64>, Option<DType>);
    let cases: Vec<Case> = vec![
        (vec![7, 5], vec![0, 0], vec![7, 6], Some(DType::F32)), // global shape differs
        (vec![7, 5], vec![0, 0], vec![7, 5], Some(DType::F64)), // dtype differs
        (vec![4, 5], vec![4, 0], vec![7, 5], Some(DType::F32)), // box past the end
    ];
    for (shape, offsets, global, dtype) in cases {
        let name = "w";
        let mut first = vec![0xAAu8; 12];
        let mut bad = [0xAAu8; 7 * 5 * 4];
        let n: u64 = shape.iter().product();
        let bad = &mut bad[..(n * 4) as usize];
        let mut t = target(name, &shape, &offsets, &global, bad);
        t.dtype = dtype;
        let err = cp
            .load_boxes_into(&id, vec![target("b", &[3], &[0], &[3], &mut first), t])
            .await
            .unwrap_err();
        assert!(
            matches!(err, Error::InvalidInput(ref m) if m.contains("`w`")),
            "{err}"
        );
        assert!(
            first.iter().all(|&x| x == 0xAA),
            "a buffer was written before the check"
        );
    }
    let mut missing = vec![0u8; 4];
    let err = cp
        .load_boxes_into(&id, vec![target("nope", &[1], &[0], &[1], &mut missing)])
        .await
        .unwrap_err();
    assert!(matches!(err, Error::NotFound { .. }), "{err}");
}
