//! Crash tests of the `tch_train` example: a run killed (SIGKILL at seeded random
//! steps, an abort inside a save, a SIGKILL while a save is in flight) and restarted
//! from its newest checkpoint ends with the same weights, bit for bit, as a run
//! that was never interrupted.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Stdio};
use std::sync::OnceLock;

use ckpt_core::torch::tch;

const BIN: &str = env!("CARGO_BIN_EXE_tch_train");
const STEPS: u64 = 60;
const EVERY: u64 = 5;
const SEED: u64 = 20;

/// One process of the example: what it printed and how it ended.
struct Run {
    lines: Vec<String>,
    status: ExitStatus,
}

impl Run {
    fn resumed_from(&self) -> Option<u64> {
        self.lines
            .iter()
            .find_map(|l| l.strip_prefix("resumed from step ")?.parse().ok())
    }

    fn last_started(&self) -> Option<u64> {
        self.lines.iter().rev().find_map(|l| {
            l.strip_prefix("checkpoint ")?
                .strip_suffix(" started")?
                .parse()
                .ok()
        })
    }

    fn finished(&self) -> bool {
        self.status.success()
            && self.lines.last().map(String::as_str) == Some(&*format!("done {STEPS}"))
    }
}

/// Run the example once; SIGKILL it as soon as `kill_after` says so of a line.
fn run(
    root: &Path,
    out: &Path,
    device: &str,
    env: &[(&str, &str)],
    kill_after: impl Fn(&str) -> bool,
) -> Run {
    let mut cmd = Command::new(BIN);
    cmd.args([
        "--root",
        root.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
    ])
    .args(["--steps", &STEPS.to_string(), "--every", &EVERY.to_string()])
    .args(["--seed", &SEED.to_string(), "--device", device])
    .env_remove("CKPT_FAILPOINTS")
    .stdout(Stdio::piped())
    .stderr(Stdio::inherit());
    for (k, v) in env {
        cmd.env(k, v);
    }
    let mut child = cmd.spawn().expect("start the example");
    let stdout = child.stdout.take().unwrap();
    let mut lines = Vec::new();
    let mut killed = false;
    for line in BufReader::new(stdout).lines() {
        let line = line.expect("read the example's output");
        if !killed && kill_after(&line) {
            // std's kill is SIGKILL on Unix: no destructors, no flush.
            let _ = child.kill();
            killed = true;
        }
        lines.push(line);
    }
    let status = child.wait().unwrap();
    Run { lines, status }
}

fn step_of(line: &str) -> Option<u64> {
    line.strip_prefix("step ")?.split(' ').next()?.parse().ok()
}

/// The weights of a run that was never interrupted (computed once per device).
fn reference(device: &str) -> Vec<u8> {
    static CPU: OnceLock<Vec<u8>> = OnceLock::new();
    static CUDA: OnceLock<Vec<u8>> = OnceLock::new();
    let cell = if device == "cpu" { &CPU } else { &CUDA };
    cell.get_or_init(|| {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("weights");
        let r = run(&dir.path().join("ckpt"), &out, device, &[], |_| false);
        assert!(
            r.finished(),
            "the straight run failed: {:?}",
            r.lines.last()
        );
        assert_eq!(r.lines.first().map(String::as_str), Some("fresh start"));
        std::fs::read(out).unwrap()
    })
    .clone()
}

/// Restart the example (no failpoints) until it finishes; return its weights and
/// the step each restart resumed from.
fn finish(root: &Path, out: &Path, device: &str) -> (Vec<u8>, Option<u64>) {
    let r = run(root, out, device, &[], |_| false);
    assert!(r.finished(), "the restarted run failed: {:?}", r.lines);
    (std::fs::read(out).unwrap(), r.resumed_from())
}

fn work_dir() -> (tempfile::TempDir, PathBuf, PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("ckpt");
    let out = dir.path().join("weights");
    (dir, root, out)
}

/// Kill steps drawn from a fixed seed, sorted and distinct.
fn kill_steps(seed: u64, n: usize) -> Vec<u64> {
    let mut rng = ckpt_core::testing::Xorshift::new(seed);
    let mut steps = Vec::new();
    while steps.len() < n {
        let s = 1 + rng.next_u64() % (STEPS - 2);
        if !steps.contains(&s) {
            steps.push(s);
        }
    }
    steps.sort_unstable();
    steps
}

fn sigkill_at_random_steps(device: &str) {
    let want = reference(device);
    let (_dir, root, out) = work_dir();
    let mut resumes = Vec::new();
    for k in kill_steps(0x5eed_1234, 3) {
        let r = run(&root, &out, device, &[], |l| {
            step_of(l).is_some_and(|s| s >= k)
        });
        if r.finished() {
            continue; // it got to the end before the signal landed
        }
        assert!(!r.status.success(), "killed at step {k} but exited cleanly");
        assert!(!out.exists(), "a killed run wrote final weights");
        let reached = r.lines.iter().filter_map(|l| step_of(l)).max().unwrap_or(0);
        eprintln!(
            "{device}: killed at step {k} (reached {reached}), it had resumed from {:?}",
            r.resumed_from()
        );
        if let Some(from) = r.resumed_from() {
            resumes.push(from);
            assert_eq!(from % EVERY, 0);
            assert!(from <= reached);
        }
    }
    let (got, from) = finish(&root, &out, device);
    resumes.extend(from);
    assert!(
        resumes.iter().any(|&s| s > 0),
        "no restart resumed from a checkpoint: {resumes:?}"
    );
    assert_eq!(got.len(), want.len());
    assert!(
        got == want,
        "weights after kills and restarts differ from the straight run"
    );
}

#[test]
fn sigkill_at_random_steps_then_resume_is_bitwise_identical() {
    sigkill_at_random_steps("cpu");
}

#[test]
fn abort_inside_a_save_then_resume_is_bitwise_identical() {
    let want = reference("cpu");
    let (_dir, root, out) = work_dir();
    // The model and Adam state are small tensors, packed into one chunk per save:
    // the third object written dies inside the third save, after its data and
    // before its manifest.
    let r = run(
        &root,
        &out,
        "cpu",
        &[("CKPT_FAILPOINTS", "save.mid_data=3*abort")],
        |_| false,
    );
    assert!(!r.status.success(), "the failpoint did not stop the run");
    let torn = r.last_started().expect("a save was in flight");
    let (got, from) = finish(&root, &out, "cpu");
    eprintln!("aborted inside the save of step {torn}; resumed from {from:?}");
    assert!(
        from.unwrap_or(0) < torn,
        "resumed from {from:?}, but the save of step {torn} never committed"
    );
    assert!(got == want, "weights after an abort inside a save differ");
}

#[test]
fn sigkill_while_a_save_is_in_flight_then_resume_is_bitwise_identical() {
    let want = reference("cpu");
    let (_dir, root, out) = work_dir();
    // The second save (step 10) sleeps before its manifest; kill the process while
    // it sleeps, with the data written and the commit not yet made.
    let env = [("CKPT_FAILPOINTS", "save.before_manifest=2*sleep(20000)")];
    let r = run(&root, &out, "cpu", &env, |l| {
        step_of(l) == Some(2 * EVERY + 3)
    });
    assert!(!r.status.success(), "the run was not killed");
    assert_eq!(r.last_started(), Some(2 * EVERY));
    let (got, from) = finish(&root, &out, "cpu");
    assert_eq!(from, Some(EVERY), "the uncommitted save must not be loaded");
    assert!(got == want, "weights after a kill during a save differ");
}

#[test]
fn cuda_sigkill_at_random_steps_then_resume_is_bitwise_identical() {
    if !tch::Cuda::is_available() {
        eprintln!("skipped: no CUDA device (the CUDA training run needs a GPU)");
        return;
    }
    sigkill_at_random_steps("cuda");
}
