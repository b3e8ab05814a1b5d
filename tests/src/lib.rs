//! Shared helpers of the integration tests: generated states, comparisons, temp roots.

use bytes::Bytes;
use std::sync::Arc;

use ckpt_core::{Capture, Checkpointer, DType, Key, SharedVec, State, Tensor, Value};

pub use ckpt_core::testing::seeded_bytes as bytes_for;

/// A tensor of `dtype` and `shape` filled with seeded bytes.
pub fn tensor(name: &str, dtype: DType, shape: &[u64], seed: u64) -> Tensor {
    let numel: u64 = shape.iter().product();
    let len = dtype.byte_len(numel).expect("whole bytes") as usize;
    Tensor::new(
        name,
        dtype,
        shape.to_vec(),
        Bytes::from(bytes_for(seed, len)),
    )
    .expect("valid tensor")
}

/// A state with one tensor of every dtype, an empty tensor, a 0-d tensor, nested
/// names, and non-tensor state of every kind.
pub fn every_dtype_state(seed: u64) -> State {
    let mut state = State::new();
    for (i, d) in DType::ALL.iter().enumerate() {
        // Shapes whose element count fills whole bytes for 4- and 6-bit types.
        state = state.with_tensor(tensor(
            &format!("dtypes.{}", d.name()),
            *d,
            &[4, 6],
            seed + i as u64,
        ));
    }
    state
        .with_tensor(tensor("model.empty", DType::F32, &[0, 7], seed))
        .with_tensor(tensor("model.scalar", DType::F64, &[], seed + 100))
        .with_tensor(tensor(
            "optimizer.state.0.exp_avg",
            DType::BF16,
            &[3, 5, 2],
            seed + 101,
        ))
        .with_meta(sample_meta())
}

/// Plain-data state of every kind of value.
pub fn sample_meta() -> Value {
    Value::map([
        (Key::from("step"), Value::Int(1234)),
        (Key::from("lr"), Value::Float(3e-4)),
        (
            Key::from("nan"),
            Value::Float(f64::from_bits(0x7ff8_0000_dead_beef)),
        ),
        (Key::from("inf"), Value::Float(f64::NEG_INFINITY)),
        (Key::from("name"), Value::Str("run-7 ✓".into())),
        (Key::from("none"), Value::Null),
        (Key::from("flag"), Value::Bool(true)),
        (Key::from("rng"), Value::Bytes(vec![0, 1, 2, 255])),
        (
            Key::from("betas"),
            Value::Tuple(vec![Value::Float(0.9), Value::Float(0.999)]),
        ),
        (
            Key::from("state"),
            Value::map([(
                Key::Int(0),
                Value::map([("exp_avg", Value::Tensor("optimizer.state.0.exp_avg".into()))]),
            )]),
        ),
        (
            Key::from("list"),
            Value::List(vec![Value::Int(-1), Value::Str("x".into())]),
        ),
    ])
}

/// A state of `n` F32 tensors of `elems` elements each.
pub fn f32_state(n: usize, elems: u64, seed: u64) -> State {
    (0..n).fold(State::new(), |s, i| {
        s.with_tensor(tensor(
            &format!("layer{i}.weight"),
            DType::F32,
            &[elems],
            seed + i as u64,
        ))
    })
}

/// Compare states bitwise, floats in meta by bits; panics with the first difference.
pub fn assert_same(a: &State, b: &State) {
    assert_eq!(a.tensors.len(), b.tensors.len(), "tensor count");
    for (x, y) in a.tensors.iter().zip(&b.tensors) {
        assert_eq!(x.name, y.name);
        assert_eq!(x.dtype, y.dtype, "{}", x.name);
        assert_eq!(x.shape, y.shape, "{}", x.name);
        assert_eq!(x.shard, y.shard, "{}", x.name);
        assert!(x.data == y.data, "tensor {} differs", x.name);
    }
    let ja = serde_json_bits(&a.meta);
    let jb = serde_json_bits(&b.meta);
    assert_eq!(ja, jb, "meta differs");
}

fn serde_json_bits(v: &Value) -> String {
    // Value's serialization stores non-finite floats by their bits and finite ones exactly.
    serde_json::to_string(v).expect("meta serializes")
}

/// A fresh temporary directory and its `file://` URL.
pub fn temp_root() -> (tempfile::TempDir, String) {
    let dir = tempfile::tempdir().expect("tempdir");
    let url = format!("file://{}", dir.path().display());
    (dir, url)
}

/// A unique `memory://` URL.
pub fn memory_root(tag: &str) -> String {
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(0);
    format!(
        "memory://{tag}-{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    )
}

/// The steps of the checkpoints `cp` counts as committed, oldest first.
pub async fn committed_steps(cp: &Checkpointer) -> ckpt_core::Result<Vec<u64>> {
    Ok(cp.committed().await?.iter().map(|i| i.step).collect())
}

/// Open a native-format checkpointer with small chunks (so tests span many chunks).
pub async fn open_small_chunks(url: &str) -> Checkpointer {
    let mut opts = ckpt_core::CheckpointerOptions::default();
    opts.write.chunk_size = 4096;
    ckpt_formats::builder(url)
        .options(opts)
        .build()
        .await
        .expect("open checkpointer")
}

/// Path of a stored object under a `file://` root.
pub fn file_of(root: &std::path::Path, key: &str) -> std::path::PathBuf {
    root.join(key)
}

/// A capture of `n` mutable F32 buffers of `elems` elements (copied at snapshot
/// time), and the buffers, which the test may mutate as a training loop would.
pub fn mutable_state(n: usize, elems: usize, seed: u64) -> (Vec<Arc<SharedVec>>, Capture) {
    let vecs: Vec<Arc<SharedVec>> = (0..n)
        .map(|i| SharedVec::new(bytes_for(seed + i as u64, elems * 4)))
        .collect();
    let cap = vecs
        .iter()
        .enumerate()
        .fold(Capture::default(), |c, (i, v)| {
            c.with_copy(format!("p{i}"), DType::F32, vec![elems as u64], v.clone())
        });
    (vecs, cap)
}

/// A name no other test run uses (process id, time, counter).
pub fn unique(name: &str) -> String {
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    format!(
        "{name}-{}-{nanos}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    )
}

/// `s3://bucket/<unique prefix>`, or `None` (skip) when no S3 server is configured.
/// Under CI (`CI=true`) a missing configuration fails the test instead.
pub fn s3_url(name: &str) -> Option<String> {
    let have = ["AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT"]
        .iter()
        .all(|k| std::env::var(k).is_ok());
    if !have {
        let ci = std::env::var("CI").is_ok_and(|v| v == "true" || v == "1");
        assert!(!ci, "S3 tests need AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY and AWS_ENDPOINT (scripts/test.sh starts Garage and sets them)");
        eprintln!("skipping S3 test `{name}`: no AWS_* variables (run scripts/test.sh, or eval \"$(scripts/garage.sh start)\")");
        return None;
    }
    let bucket = std::env::var("CKPT_S3_BUCKET").unwrap_or_else(|_| "ckpt-test".into());
    Some(format!("s3://{bucket}/{}", unique(name)))
}
