//! The `ckpt` binary as a user runs it.

use std::process::{Command, Output};

use ckpt_core::{State, Tensor, Value};

/// The command, started with no library path unless this build links libtorch
/// (a workspace build with every feature: see the last test).
fn command() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_ckpt"));
    if !ckpt_core::LINKS_LIBTORCH {
        c.env_remove("LD_LIBRARY_PATH");
    }
    c
}

fn ckpt(args: &[&str]) -> Output {
    command().args(args).output().unwrap()
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

fn save(root: &str, steps: &[u64]) {
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let cp = ckpt_formats::builder(root).build().await.unwrap();
        for &s in steps {
            let state = State::new()
                .with_tensor(Tensor::from_f32("model.w", vec![2], &[1.0, 2.0]).unwrap())
                .with_tensor(Tensor::from_f32("optimizer.m", vec![1], &[3.0]).unwrap())
                .with_meta(Value::map([("step", Value::Int(s as i64))]));
            cp.save(s, &state).await.unwrap().wait().await.unwrap();
        }
    });
}

#[test]
fn list_prints_a_table_and_json() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("run");
    let root = root.to_str().unwrap();
    save(root, &[10, 20]);

    let out = ckpt(&["list", root, "--verify"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let table = text(&out.stdout);
    let lines: Vec<&str> = table.lines().collect();
    assert!(
        lines[0].starts_with("STEP") && lines[0].ends_with("STATUS"),
        "{table}"
    );
    assert!(
        lines[1].trim_start().starts_with("10 ") && lines[1].ends_with("verified"),
        "{table}"
    );
    assert!(
        lines[2].contains("native") && lines[2].contains("12 B"),
        "{table}"
    );
    assert_eq!(lines[3], "2 verified, 0 corrupt");

    let out = ckpt(&["list", root, "--json"]);
    assert!(out.status.success());
    let rows: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(rows.as_array().unwrap().len(), 2);
    assert_eq!(rows[1]["step"], 20);
    assert_eq!(rows[1]["bytes"], 12);
    assert_eq!(rows[1]["format"], "native");
    assert_eq!(rows[1]["status"], "committed");
    assert_eq!(rows[1]["verified"], false, "not read without --verify");
    assert_eq!(rows[1]["epoch"], 1, "the writer's epoch");
}

/// A writer that never claimed an epoch (fencing off, as a build before epochs)
/// commits after a job claimed the root: `ckpt list` shows it as fenced, and
/// `ckpt gc`, which claims nothing, retires it and leaves the job unfenced.
#[test]
fn list_shows_epochs_and_fenced_checkpoints() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("run");
    let root = root.to_str().unwrap();
    save(root, &[10]);
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let opts = ckpt_core::CheckpointerOptions {
            fencing: false,
            ..Default::default()
        };
        let old = ckpt_formats::builder(root)
            .options(opts)
            .build()
            .await
            .unwrap();
        let state = State::new().with_tensor(Tensor::from_f32("w", vec![1], &[5.0]).unwrap());
        old.save(30, &state).await.unwrap().wait().await.unwrap();
    });
    let out = ckpt(&["list", root, "--json"]);
    let rows: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(rows[1]["step"], 30);
    assert_eq!(rows[1]["status"], "fenced");
    assert_eq!(rows[1]["epoch"], 0);
    let table = text(&ckpt(&["list", root]).stdout);
    assert!(table.lines().next().unwrap().contains("EPOCH"), "{table}");
    assert!(table.contains("fenced"), "{table}");

    let out = ckpt(&["gc", root, "--keep-last", "5", "--grace-secs", "0"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(
        text(&out.stdout).starts_with("retired 1 checkpoints"),
        "{}",
        text(&out.stdout)
    );
    let out = ckpt(&["list", root, "--json"]);
    let rows: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(rows.as_array().unwrap().len(), 1);
    assert_eq!(rows[0]["step"], 10);
    // The gc claimed nothing: the only claim is the saving job's.
    assert!(dir
        .path()
        .join("run/epochs/00000000000000000001.claim")
        .exists());
    assert!(!dir
        .path()
        .join("run/epochs/00000000000000000002.claim")
        .exists());
}

#[test]
fn export_names_the_entries_when_the_entry_is_wrong() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("run");
    let root = root.to_str().unwrap();
    save(root, &[1]);
    let out_file = dir.path().join("m.safetensors");
    let out = ckpt(&[
        "export",
        root,
        out_file.to_str().unwrap(),
        "--entry",
        "weights",
    ]);
    assert_eq!(out.status.code(), Some(2));
    let err = text(&out.stderr);
    assert!(
        err.contains("`weights`") && err.contains("model, optimizer"),
        "{err}"
    );
    assert!(!out_file.exists());

    let out = ckpt(&[
        "export",
        root,
        out_file.to_str().unwrap(),
        "--entry",
        "model",
        "--dtype",
        "bf16",
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(
        text(&out.stdout).contains("1 tensors of `model`"),
        "{}",
        text(&out.stdout)
    );
    let bytes = bytes::Bytes::from(std::fs::read(&out_file).unwrap());
    let s = ckpt_formats::safetensors::read_file(&bytes).unwrap();
    assert_eq!(s.tensors[0].name, "w");
    assert_eq!(s.tensors[0].dtype, ckpt_core::DType::BF16);
}

/// The default build opens s3:// (it fails here only for want of a server) and
/// starts with no library path: it does not link libtorch.
#[test]
fn s3_is_built_in_and_libtorch_is_not_needed() {
    let out = command()
        .args(["list", "s3://no-such-bucket/run"])
        .env("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
        .env("AWS_ACCESS_KEY_ID", "x")
        .env("AWS_SECRET_ACCESS_KEY", "x")
        .env("AWS_REGION", "garage")
        .env("AWS_ALLOW_HTTP", "true")
        .env("AWS_MAX_ATTEMPTS", "1")
        .output()
        .unwrap();
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(!err.contains("feature"), "{err}");
    // A workspace build with every feature compiles ckpt-core once, with `torch`,
    // for every crate; `cargo build -p ckpt-cli` (and scripts/test.sh's own run of
    // these tests) does not.
    if ckpt_core::LINKS_LIBTORCH {
        return;
    }
    if let Ok(ldd) = Command::new("ldd").arg(env!("CARGO_BIN_EXE_ckpt")).output() {
        let libs = text(&ldd.stdout);
        assert!(
            !libs.contains("libtorch") && !libs.contains("libc10"),
            "{libs}"
        );
    }
}

/// An operator rolls a stopped job back: the later checkpoints are gone, the
/// job's restart resumes from the step, and a mistyped step discards nothing.
#[test]
fn discard_after_rolls_a_stopped_job_back() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("run");
    let root = root.to_str().unwrap();
    save(root, &[10, 20, 30]);

    let out = ckpt(&["discard-after", root, "15"]);
    assert_eq!(out.status.code(), Some(2), "{}", text(&out.stdout));
    assert!(
        text(&out.stderr).contains("no committed checkpoint of step 15"),
        "{}",
        text(&out.stderr)
    );
    let out = ckpt(&["discard-after", root, "10", "--grace-secs", "0"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(
        text(&out.stdout).starts_with("discarded 2 checkpoints after step 10 (20, 30)"),
        "{}",
        text(&out.stdout)
    );
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let cp = ckpt_formats::builder(root).build().await.unwrap();
        assert_eq!(cp.load_latest().await.unwrap().unwrap().id.step, 10);
        let ids = cp.committed().await.unwrap();
        assert_eq!(ids.iter().map(|id| id.step).collect::<Vec<_>>(), [10]);
    });
    assert_eq!(
        std::fs::read_dir(dir.path().join("run/manifests"))
            .unwrap()
            .count(),
        1
    );
}
