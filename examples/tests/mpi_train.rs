//! The data-parallel example under mpirun: a run with a rank that dies, restarted
//! from its newest checkpoint, ends with the same weights, bit for bit, as a run
//! that was never interrupted. (That replicated tensors are written once is
//! measured in `tests/tests/mpi.rs`.)

use std::process::Output;

fn mpirun(np: usize, args: &[&str]) -> Output {
    ckpt_core::testing::mpirun(np)
        .arg(env!("CARGO_BIN_EXE_mpi_train"))
        .args(args)
        .output()
        .expect("mpirun runs (OpenMPI installed?)")
}

fn ok(out: &Output) {
    assert!(
        out.status.success(),
        "{}\nstdout:\n{}\nstderr:\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn killed_and_resumed_run_matches_the_straight_run() {
    let dir = tempfile::tempdir().unwrap();
    let straight = dir.path().join("straight");
    let crashed = dir.path().join("crashed");
    let (a, b) = (dir.path().join("a.w"), dir.path().join("b.w"));
    let common = ["--steps", "30", "--every", "5"];

    let s = straight.to_str().unwrap();
    let mut args = vec!["--root", s, "--out", a.to_str().unwrap()];
    args.extend(common);
    ok(&mpirun(3, &args));

    // Rank 2 dies at step 17: the job fails, the checkpoint of step 15 is the latest.
    let c = crashed.to_str().unwrap();
    let mut args = vec![
        "--root",
        c,
        "--out",
        b.to_str().unwrap(),
        "--die-at",
        "17",
        "--die-rank",
        "2",
    ];
    args.extend(common);
    assert!(!mpirun(3, &args).status.success());
    assert!(!b.exists());
    let mut args = vec!["--root", c, "--out", b.to_str().unwrap()];
    args.extend(common);
    let out = mpirun(3, &args);
    ok(&out);
    assert!(String::from_utf8_lossy(&out.stdout).contains("resumed from step 15"));

    assert_eq!(
        std::fs::read(&a).unwrap(),
        std::fs::read(&b).unwrap(),
        "final weights differ"
    );
}
