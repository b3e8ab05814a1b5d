//! The S3 experiment against a real S3 server (Garage on loopback, started by
//! `scripts/test.sh`): every method moves the same bytes, ckpt's loads come back
//! equal (checked inside the experiment), and each target compares ckpt with
//! the baseline measured in the same run. Skipped without the AWS_* variables.

use ckpt_core::{State, Tensor};
use ckpt_eval::experiments::s3::{dcp_peers, dcp_table, dcp_targets, S3Bench, S3_BOUND};

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

/// The DCP storage peers from Python on the same server: s3torchconnector's
/// DCP writer and reader (from PyPI), ckpt's, and ckpt's Checkpointer, each
/// load checked equal inside the script; the targets are the ratios of the
/// rows' medians.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_dcp_storage_peers_run_on_the_same_server() {
    let Some(url) = s3_root() else { return };
    let Some(py) = ckpt_eval::python::interpreter() else {
        eprintln!("skipping: no Python interpreter (scripts/setup.sh makes .venv)");
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let v = dcp_peers(&py, &url, 4.0, 1, dir.path()).await.unwrap();
    let methods = v["methods"].as_array().unwrap();
    let names: Vec<&str> = methods
        .iter()
        .map(|m| m["name"].as_str().unwrap())
        .collect();
    assert_eq!(
        names,
        [
            "s3torchconnector dcp.save",
            "dcp.save -> ckpt",
            "ckpt Checkpointer"
        ]
    );
    for m in methods {
        assert!(m["skipped"].is_null(), "{m}");
        assert_eq!(m["save_s"].as_array().unwrap().len(), 1, "{m}");
    }
    let table = dcp_table(&v, "here");
    assert_eq!(table.rows.len(), 3);
    let targets = dcp_targets(&v);
    assert_eq!(targets.len(), 4, "{targets:?}");
    let save = |i: usize| methods[i]["save_s"][0].as_f64().unwrap();
    assert!(
        (targets[0].ratio - save(1) / save(0)).abs() < 1e-9,
        "{targets:?}"
    );
    assert_eq!(targets[0].met, targets[0].ratio <= 1.0);
    // Nothing is left under the prefix.
    let store = ckpt_core::store::open_url(&url).unwrap();
    use futures::TryStreamExt;
    use object_store::ObjectStore;
    let left: Vec<_> = store.list(None).try_collect().await.unwrap();
    assert!(left.is_empty(), "{left:?}");
}
