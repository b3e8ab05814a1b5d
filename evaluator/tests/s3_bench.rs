//! The S3 experiment against a real S3 server (Garage on loopback, started by
//! `scripts/test.sh`): every method moves the same bytes, ckpt's loads come back
//! equal (checked inside the experiment), and each target compares ckpt with
//! the baseline measured in the same run. Skipped without the AWS_* variables.

use ckpt_core::{State, Tensor};
use ckpt_eval::experiments::s3::{S3Bench, S3_BOUND};

fn s3_root() -> Option<String> {
    let have = ["AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT"]
        .iter()
        .all(|k| std::env::var(k).is_ok());
    if !have {
        eprintln!("skipping: no AWS_* variables (scripts/test.sh starts Garage and sets them)");
        return None;
    }
    let bucket = std::env::var("CKPT_S3_BUCKET").unwrap_or_else(|_| "ckpt-test".into());
    let stamp = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default()
        .as_nanos();
    Some(format!(
        "s3://{bucket}/eval-s3-{}-{stamp}",
        std::process::id()
    ))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_s3_experiment_measures_ckpt_beside_the_plain_transfers() {
    let Some(url) = s3_root() else { return };
    // Big tensors (several chunks and parts) and small ones (packed).
    let mut state = State::new();
    for (i, n) in [(0usize, 5usize << 20), (1, 3 << 20), (2, 1000), (3, 17)] {
        let v: Vec<f32> = (0..n).map(|k| (k * 31 + i) as f32).collect();
        state = state.with_tensor(Tensor::from_f32(format!("t{i}"), vec![n as u64], &v).unwrap());
    }
    let res = S3Bench { url, repeats: 1 }.run(&state).await.unwrap();
    let names: Vec<&str> = res.rows.iter().map(|r| r.name.as_str()).collect();
    assert_eq!(
        names,
        [
            "object_store multipart / ranged",
            "ckpt native",
            "ckpt safetensors"
        ]
    );
    assert_eq!(res.state_bytes, state.nbytes());
    for r in &res.rows {
        assert!(r.save_s.median > 0.0 && r.load_s.median > 0.0, "{r:?}");
        assert!(r.objects >= 1, "{r:?}");
    }
    // Native writes one object per chunk (and its manifest); safetensors fewer.
    assert!(res.rows[1].objects > res.rows[2].objects, "{:?}", res.rows);
    assert_eq!(res.targets.len(), 2);
    for t in &res.targets {
        let base = if t.what.contains("save") {
            res.rows[0].save_s.median
        } else {
            res.rows[0].load_s.median
        };
        let mine = if t.what.contains("save") {
            res.rows[1].save_s.median
        } else {
            res.rows[1].load_s.median
        };
        assert!((t.ratio - mine / base).abs() < 1e-9, "{t:?}");
        assert_eq!(t.met, t.ratio <= S3_BOUND);
    }
}
