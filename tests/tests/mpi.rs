//! Distributed checkpoints under `mpirun`: N ranks save, M ranks load, bitwise;
//! replicated tensors stored once; a rank killed mid-save or absent leaves the
//! previous checkpoint as the latest, and nobody hangs.
#![cfg(feature = "mpi")]

use std::process::Output;

use ckpt_core::testing::report::{parse_lines, RankReport};
use ckpt_tests::temp_root;

fn mpirun(np: usize, args: &[&str]) -> Output {
    ckpt_core::testing::mpirun(np)
        .arg(env!("CARGO_BIN_EXE_mpi_ckpt"))
        .args(args)
        .output()
        .expect("mpirun runs (OpenMPI installed?)")
}

fn lines(out: &Output) -> Vec<RankReport> {
    parse_lines(&String::from_utf8_lossy(&out.stdout)).unwrap()
}

/// The step every rank loaded (`None` for a rank that reported something else).
fn loaded_steps(out: &Output) -> Vec<Option<u64>> {
    lines(out).iter().map(RankReport::loaded_step).collect()
}

fn ok(out: &Output, what: &str) {
    assert!(
        out.status.success(),
        "{what} failed: {}\nstdout:\n{}\nstderr:\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The job failed, and every one of its `n` ranks reported a failure that `what` accepts.
fn every_rank_failed(out: &Output, n: usize, what: impl Fn(&RankReport) -> bool) {
    assert!(!out.status.success());
    let reports = lines(out);
    assert_eq!(reports.len(), n, "{reports:?}");
    for r in &reports {
        assert!(what(r), "{r:?}");
    }
}

/// Two ranks load the root, and both get step 1.
fn step_1_is_the_latest(url: &str) {
    let out = mpirun(2, &["load", url]);
    ok(&out, "load");
    assert!(loaded_steps(&out).iter().all(|s| *s == Some(1)));
}

#[test]
fn n_ranks_save_m_ranks_load() {
    for (n, m) in [(1, 4), (4, 1), (2, 4), (4, 2)] {
        let (_dir, url) = temp_root();
        let out = mpirun(n, &["save", &url, "7"]);
        ok(&out, &format!("save with {n} ranks"));
        assert_eq!(lines(&out).len(), n);
        let out = mpirun(m, &["load", &url]);
        ok(
            &out,
            &format!("load with {m} ranks of a {n}-rank checkpoint"),
        );
        let rows = lines(&out);
        assert_eq!(rows.len(), m);
        for r in rows {
            assert!(
                matches!(r, RankReport::Loaded { loaded_step: 7, saved_world, .. } if saved_world == n),
                "{r:?}"
            );
        }
    }
}

#[test]
fn replicated_tensors_are_stored_once_and_the_writing_is_spread() {
    let (dir, url) = temp_root();
    let out = mpirun(4, &["save", &url, "3"]);
    ok(&out, "save");
    let rows = lines(&out);
    let raw: Vec<u64> = rows
        .iter()
        .map(|r| match r {
            RankReport::Saved { raw_bytes, .. } => *raw_bytes,
            other => panic!("not a save: {other:?}"),
        })
        .collect();
    // Sizes of the job's state (see mpi_ckpt.rs): shards 24*16 + 6*48 f32, 8 replicated
    // tensors of (k+1)*3000 f32, one 64-f32 local tensor per rank.
    let shards = (24 * 16 + 6 * 48) * 4;
    let replicated: u64 = (0..8).map(|k| (k + 1) * 3000 * 4).sum();
    let locals = 4 * 64 * 4;
    assert_eq!(
        raw.iter().sum::<u64>(),
        shards + replicated + locals,
        "every byte written exactly once: {raw:?}"
    );
    // Balanced: no rank writes much more than a quarter (the largest tensor is the slack).
    let largest = 8 * 3000 * 4;
    let fair = (shards + replicated + locals) / 4;
    assert!(raw.iter().all(|&b| b <= fair + largest), "{raw:?}");
    // What is on disk: the chunk bytes equal the unique bytes plus a header per chunk.
    let stored: u64 = std::fs::read_dir(dir.path().join("chunks"))
        .unwrap()
        .map(|e| e.unwrap().metadata().unwrap().len())
        .sum();
    let chunks = std::fs::read_dir(dir.path().join("chunks"))
        .unwrap()
        .count() as u64;
    let header = ckpt_formats::native::chunk::HEADER_LEN as u64;
    assert_eq!(stored, shards + replicated + locals + header * chunks);
}

#[test]
fn a_rank_killed_mid_save_leaves_the_previous_checkpoint() {
    let (_dir, url) = temp_root();
    ok(&mpirun(4, &["save", &url, "1"]), "first save");
    let out = mpirun(
        4,
        &["save", &url, "2", "--abort-rank", "2", "--timeout-s", "20"],
    );
    assert!(
        !out.status.success(),
        "the job with a killed rank must fail"
    );
    let out = mpirun(2, &["load", &url]);
    ok(&out, "load after the crash");
    assert!(loaded_steps(&out).iter().all(|s| *s == Some(1)));
}

#[test]
fn an_absent_rank_makes_the_others_time_out_instead_of_hanging() {
    let (_dir, url) = temp_root();
    ok(&mpirun(2, &["save", &url, "1"]), "first save");
    let t = std::time::Instant::now();
    let out = mpirun(
        3,
        &["save", &url, "2", "--absent-rank", "1", "--timeout-s", "3"],
    );
    assert!(!out.status.success());
    // Both ranks that waited name the absent one, in the same typed error.
    let stderr = String::from_utf8_lossy(&out.stderr);
    for r in [0, 2] {
        let named = format!("rank {r}: error: timed out: save of step 2");
        let line = stderr.lines().find(|l| l.starts_with(&named));
        assert!(
            line.is_some_and(|l| l.ends_with("1 of 3 ranks were not taking part: 1")),
            "{stderr}"
        );
    }
    let failed: Vec<_> = lines(&out)
        .into_iter()
        .filter(|r| matches!(r, RankReport::SaveFailed { error, .. } if error == "stragglers"))
        .collect();
    assert_eq!(failed.len(), 2, "{failed:?}");
    assert!(t.elapsed() < std::time::Duration::from_secs(120));
    let out = mpirun(1, &["load", &url]);
    ok(&out, "load");
    assert!(loaded_steps(&out).iter().all(|s| *s == Some(1)));
}

/// One rank's disk fills up during a save: every rank gets the storage error
/// with `ENOSPC` (the same variant, not a string turned internal), and the
/// previous checkpoint stays the newest.
#[test]
fn a_full_disk_on_one_rank_is_a_storage_error_on_every_rank() {
    let (_dir, url) = temp_root();
    ok(&mpirun(3, &["save", &url, "1"]), "first save");
    let out = mpirun(3, &["save", &url, "2", "--enospc-rank", "1"]);
    every_rank_failed(
        &out,
        3,
        |r| matches!(r, RankReport::SaveFailed { error, errno: Some(28), .. } if error == "storage"),
    );
    step_1_is_the_latest(&url);
}

/// A rank whose metadata differs from rank 0's (only rank 0's is stored, and
/// every rank would load it) fails the save on every rank, before anything is
/// written; the previous checkpoint stays the latest.
#[test]
fn a_rank_with_metadata_of_its_own_fails_the_save_on_every_rank() {
    let (_dir, url) = temp_root();
    ok(&mpirun(3, &["save", &url, "1"]), "first save");
    let out = mpirun(3, &["save", &url, "2", "--own-meta-rank", "2"]);
    every_rank_failed(
        &out,
        3,
        |r| matches!(r, RankReport::SaveFailed { error, .. } if error == "invalid"),
    );
    // Every rank says why (the ranks meet once more before they exit, in an
    // all-gather of empty messages).
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(
        stderr.matches("rank(s) [2] differs from rank 0's").count(),
        3,
        "{stderr}"
    );
    step_1_is_the_latest(&url);
}

/// `ckpt export` of a checkpoint 4 ranks saved: sharded tensors come out whole,
/// replicated ones once, as the checkpoint loads in one process.
#[test]
fn export_assembles_sharded_tensors() {
    use ckpt_formats::export::{export, ExportOptions};
    let (dir, url) = temp_root();
    ok(&mpirun(4, &["save", &url, "5"]), "save");
    let rt = tokio::runtime::Runtime::new().unwrap();
    let whole = rt.block_on(async {
        let cp = ckpt_formats::builder(url.as_str()).build().await.unwrap();
        cp.load_step(5).await.unwrap().state
    });
    let read = |p: &std::path::Path| {
        let bytes = bytes::Bytes::from(std::fs::read(p).unwrap());
        ckpt_formats::safetensors::read_file(&bytes).unwrap()
    };
    for entry in ["emb", "blocks"] {
        let out = dir.path().join(format!("{entry}.safetensors"));
        let r = rt
            .block_on(export(&url, &out, &ExportOptions::new(entry)))
            .unwrap();
        assert_eq!(r.tensors, 1);
        let got = read(&out);
        let want = whole.tensors.iter().find(|t| t.name == entry).unwrap();
        assert_eq!(
            (&got.tensors[0].shape, &got.tensors[0].data),
            (&want.shape, &want.data)
        );
    }
    let hf = dir.path().join("dense");
    let opts = ExportOptions {
        hf: true,
        max_shard_bytes: 40_000,
        ..ExportOptions::new("dense")
    };
    let r = rt.block_on(export(&url, &hf, &opts)).unwrap();
    assert_eq!(r.tensors, 8);
    assert!(r.files.len() > 2, "{:?}", r.files);
    for f in r
        .files
        .iter()
        .filter(|f| f.extension().is_some_and(|e| e == "safetensors"))
    {
        for t in read(f).tensors {
            let want = whole
                .tensors
                .iter()
                .find(|w| w.name == format!("dense.{}", t.name))
                .unwrap();
            assert_eq!(t.data, want.data, "{}", t.name);
        }
    }
}
