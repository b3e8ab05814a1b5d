//! MPI failures: one rank of a job under `mpirun` SIGKILLed.
//!
//! - [`rank_kill`]: `mpi_ckpt` (the MPI test job, every tensor a pure function of
//!   the step) saves a checkpoint with N ranks, then a second one during which one
//!   rank is SIGKILLed; the newest intact checkpoint must then load into M != N
//!   ranks, every piece verified bitwise by `mpi_ckpt load`.
//! - [`train_kill`]: `mpi_train` (the data-parallel example) loses one rank at a
//!   random instant; restarted with the same ranks it must resume from the newest
//!   intact checkpoint and end with the failure-free run's weights, bit for bit.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use ckpt_core::testing::report::{parse_lines, RankReport};

use super::inject::{pids_with_env, sigkill};
use super::plan::{Kind, Rng};
use super::record::{RunRecord, StartRecord};
use super::run::scan;

const TOKEN: &str = "CKPT_FAULT_TOKEN";

/// Where the MPI jobs are.
#[derive(Debug, Clone, Default)]
pub struct MpiBins {
    /// `mpi_ckpt` (ckpt-tests, feature `mpi`).
    pub ckpt: Option<PathBuf>,
    /// `mpi_train` (ckpt-examples, feature `mpi`).
    pub train: Option<PathBuf>,
}

/// Why MPI campaigns cannot run here, if they cannot.
pub fn unavailable(bin: &Option<PathBuf>, name: &str) -> Option<String> {
    let ok = Command::new("mpirun")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    if !ok {
        return Some("mpirun not found".into());
    }
    match bin {
        Some(p) if p.is_file() => None,
        _ => Some(format!(
            "{name} not built (cargo build -p {} --features mpi)",
            if name == "mpi_ckpt" {
                "ckpt-tests"
            } else {
                "ckpt-examples"
            }
        )),
    }
}

fn mpirun(np: u64, bin: &Path, token: &str, failpoints: &str) -> Command {
    let mut cmd = ckpt_core::testing::mpirun(np as usize);
    cmd.args(["-x", "CKPT_FAILPOINTS", "-x", TOKEN])
        .env("CKPT_FAILPOINTS", failpoints)
        .env(TOKEN, token)
        .env("RUST_LOG", "off")
        .stdin(Stdio::null())
        .arg(bin);
    cmd
}

fn output(mut cmd: Command, limit: Duration, token: &str) -> Result<Output, String> {
    let child = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("mpirun: {e}"))?;
    wait(child, limit, token)
}

/// Wait for mpirun, SIGKILLing the whole job (found by its token) past `limit`.
fn wait(mut child: Child, limit: Duration, token: &str) -> Result<Output, String> {
    let t = Instant::now();
    loop {
        match child.try_wait() {
            Ok(Some(_)) => return child.wait_with_output().map_err(|e| e.to_string()),
            Ok(None) if t.elapsed() > limit => {
                let _ = child.kill();
                for p in pids_with_env(TOKEN, token, None) {
                    sigkill(p);
                }
                let _ = child.wait();
                return Err(format!("mpirun did not finish within {limit:?}"));
            }
            Ok(None) => std::thread::sleep(Duration::from_millis(20)),
            Err(e) => return Err(e.to_string()),
        }
    }
}

fn rank_reports(o: &Output) -> Result<Vec<RankReport>, String> {
    parse_lines(&String::from_utf8_lossy(&o.stdout))
}

fn tail(o: &Output) -> String {
    let e = String::from_utf8_lossy(&o.stderr);
    let lines: Vec<&str> = e.lines().rev().take(3).collect();
    lines.into_iter().rev().collect::<Vec<_>>().join(" | ")
}

/// Start `cmd`, SIGKILL rank `rank` `delay` after it appears (or after the save's
/// first object is written, with `after_first_object`), wait for the job.
/// Returns (the job's output, where the kill landed, whether it was sent).
fn kill_rank(
    mut cmd: Command,
    token: &str,
    rank: usize,
    delay: Duration,
    root: &Path,
    after_first_object: bool,
) -> Result<(Output, String, bool), String> {
    let chunks_before = count(&root.join("chunks"));
    let manifests_before = count(&root.join("manifests"));
    let child = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("mpirun: {e}"))?;
    let t = Instant::now();
    let mut pid = None;
    while pid.is_none() && t.elapsed() < Duration::from_secs(20) {
        pid = pids_with_env(TOKEN, token, Some(rank)).first().copied();
        if pid.is_none() {
            std::thread::sleep(Duration::from_millis(5));
        }
    }
    let mut sent = false;
    let mut phase = "the rank never started".to_owned();
    if let Some(pid) = pid {
        if after_first_object {
            // Start the clock when the save's first object is durable.
            let t = Instant::now();
            while count(&root.join("chunks")) <= chunks_before
                && t.elapsed() < Duration::from_secs(20)
            {
                std::thread::sleep(Duration::from_millis(2));
            }
        }
        std::thread::sleep(delay);
        let (c, m) = (count(&root.join("chunks")), count(&root.join("manifests")));
        sent = sigkill(pid);
        phase = if !sent {
            "after the job ended".into()
        } else if m > manifests_before {
            "after the manifest".into()
        } else if c > chunks_before {
            "during the data writes".into()
        } else {
            "before any data of the save".into()
        };
    }
    let out = wait(child, Duration::from_secs(90), token)?;
    if sent && out.status.success() {
        // The rank was already gone: the job had finished.
        sent = false;
        phase = "after the job ended".into();
    }
    Ok((out, phase, sent))
}

fn count(dir: &Path) -> usize {
    std::fs::read_dir(dir).map(|d| d.count()).unwrap_or(0)
}

/// SIGKILL one rank of `mpi_ckpt` mid-save; load the newest checkpoint with M ranks.
pub fn rank_kill(bin: &Path, work: &Path, index: usize, rng: &mut Rng) -> RunRecord {
    let t0 = Instant::now();
    let n = rng.range(2, 4);
    let m = *rng.pick(
        &[1u64, 2, 3, 4]
            .iter()
            .copied()
            .filter(|m| *m != n)
            .collect::<Vec<_>>(),
    );
    let rank = rng.range(0, n - 1) as usize;
    let delay = Duration::from_millis(rng.range(0, 500));
    let mut rec = RunRecord {
        index,
        job: "mpi-rank".into(),
        detail: format!("save with {n} ranks, kill rank {rank} after {delay:?}, load with {m}"),
        ..Default::default()
    };
    let dir = work.join(format!("run-{index}"));
    let _ = std::fs::remove_dir_all(&dir);
    let _ = std::fs::create_dir_all(&dir);
    let url = format!("file://{}", dir.display());
    let token = format!("{}-{index}", std::process::id());
    let mut first = mpirun(n, bin, &token, "");
    first.args(["save", &url, "1"]);
    match output(first, Duration::from_secs(90), &token) {
        Ok(o) if o.status.success() => {}
        Ok(o) => {
            rec.problems
                .push(format!("the first save failed: {}", tail(&o)));
            return rec;
        }
        Err(e) => {
            rec.problems.push(e);
            return rec;
        }
    }
    // Hold each rank's first durable object for 600 ms: the kill's clock starts
    // when the first object is durable and its delay is under 500 ms, so the
    // kill lands inside the save whatever the number of objects and however
    // fast the disk (a per-object slowdown made the save's length depend on
    // both, and a fast save ended before a late kill).
    let mut cmd = mpirun(n, bin, &token, "save.mid_data=1*sleep(600)");
    cmd.args(["save", &url, "2", "--timeout-s", "20"]);
    let (out, phase, sent) = match kill_rank(cmd, &token, rank, delay, &dir, true) {
        Ok(x) => x,
        Err(e) => {
            rec.problems.push(e);
            return rec;
        }
    };
    if sent {
        rec.failures.push(Kind::MpiRank);
    }
    let after = scan(&dir);
    let expected = after.newest_intact().map(|c| c.id.step);
    let committed2 = after.committed.iter().any(|c| c.id.step == 2);
    if sent && !committed2 && out.status.success() {
        rec.problems
            .push("the job reported success but step 2 is not committed".into());
    }
    let mut st = StartRecord {
        kind: Some(Kind::MpiRank),
        detail: rec.detail.clone(),
        triggered: sent,
        restart: true,
        expected_resume: expected,
        ended: if sent {
            "sigkill".into()
        } else {
            "done".into()
        },
        torn: sent.then_some((2, phase)),
        ..Default::default()
    };
    let t = Instant::now();
    let mut load = mpirun(m, bin, &token, "");
    load.args(["load", &url]);
    match output(load, Duration::from_secs(90), &token) {
        Ok(o) => {
            st.recovery_ms = Some(t.elapsed().as_secs_f64() * 1e3);
            match rank_reports(&o) {
                Ok(rows) => {
                    // A rank reports `Loaded` only once it verified every byte.
                    let steps: Vec<Option<u64>> =
                        rows.iter().map(RankReport::loaded_step).collect();
                    st.resumed_from = steps.first().copied().flatten();
                    let ok = o.status.success()
                        && rows.len() == m as usize
                        && steps.iter().all(|s| s.is_some() && *s == expected);
                    rec.final_identical = Some(ok);
                    if !ok {
                        rec.problems.push(format!(
                            "load with {m} ranks: expected step {expected:?} verified on every rank, got {steps:?} ({})",
                            tail(&o)
                        ));
                    }
                    st.loaded_damaged = st.resumed_from.is_some() && st.resumed_from != expected;
                }
                Err(e) => {
                    rec.final_identical = Some(false);
                    rec.problems.push(format!("load with {m} ranks: {e}"));
                }
            }
        }
        Err(e) => rec.problems.push(e),
    }
    rec.starts.push(st);
    rec.seconds = t0.elapsed().as_secs_f64();
    if rec.passed() {
        let _ = std::fs::remove_dir_all(&dir);
    }
    rec
}

const TRAIN_STEPS: u64 = 20;
const TRAIN_EVERY: u64 = 4;

fn train_cmd(bin: &Path, n: u64, token: &str, fp: &str, root: &Path, out: &Path) -> Command {
    let mut c = mpirun(n, bin, token, fp);
    c.arg("--root")
        .arg(root)
        .arg("--out")
        .arg(out)
        .args(["--steps", &TRAIN_STEPS.to_string()])
        .args(["--every", &TRAIN_EVERY.to_string()]);
    c
}

/// SIGKILL one rank of the data-parallel example; restart; compare final weights.
pub fn train_kill(
    bin: &Path,
    work: &Path,
    index: usize,
    rng: &mut Rng,
    references: &mut HashMap<u64, Vec<u8>>,
) -> RunRecord {
    let t0 = Instant::now();
    let n = rng.range(2, 3);
    let rank = rng.range(0, n - 1) as usize;
    let delay = Duration::from_millis(rng.range(0, 1200));
    let mut rec = RunRecord {
        index,
        job: "mpi-train".into(),
        detail: format!("{n} ranks, kill rank {rank} after {delay:?}"),
        ..Default::default()
    };
    let dir = work.join(format!("run-{index}"));
    let _ = std::fs::remove_dir_all(&dir);
    let _ = std::fs::create_dir_all(&dir);
    let token = format!("{}-{index}", std::process::id());
    let want = match references.get(&n) {
        Some(w) => w.clone(),
        None => {
            let (root, out) = (dir.join("reference"), dir.join("reference.w"));
            let cmd = train_cmd(bin, n, &token, "", &root, &out);
            match output(cmd, Duration::from_secs(120), &token) {
                Ok(o) if o.status.success() => {}
                Ok(o) => {
                    rec.problems
                        .push(format!("the failure-free run failed: {}", tail(&o)));
                    return rec;
                }
                Err(e) => {
                    rec.problems.push(e);
                    return rec;
                }
            }
            let w = std::fs::read(&out).unwrap_or_default();
            references.insert(n, w.clone());
            w
        }
    };
    let (root, out) = (dir.join("ckpt"), dir.join("weights"));
    // Commits take a little longer, so some kills land between data and manifest.
    let cmd = train_cmd(
        bin,
        n,
        &token,
        "save.before_manifest=sleep(60)",
        &root,
        &out,
    );
    let (o, phase, sent) = match kill_rank(cmd, &token, rank, delay, &root, false) {
        Ok(x) => x,
        Err(e) => {
            rec.problems.push(e);
            return rec;
        }
    };
    let before = scan(&root);
    let expected = before.newest_intact().map(|c| c.id.step);
    let mut first = StartRecord {
        kind: Some(Kind::MpiTrain),
        detail: rec.detail.clone(),
        triggered: sent,
        ended: if sent {
            "sigkill".into()
        } else {
            "done".into()
        },
        torn: sent.then(|| {
            drop(phase);
            (
                0,
                format!(
                    "while training, {} checkpoints committed",
                    before.committed.len()
                ),
            )
        }),
        ..Default::default()
    };
    if sent {
        rec.failures.push(Kind::MpiTrain);
        if o.status.success() {
            rec.problems
                .push("the job with a killed rank reported success".into());
        }
    }
    let t = Instant::now();
    let cmd = train_cmd(bin, n, &token, "", &root, &out);
    let mut st = StartRecord {
        restart: sent,
        expected_resume: expected,
        ..Default::default()
    };
    match output(cmd, Duration::from_secs(120), &token) {
        Ok(o) => {
            st.recovery_ms = Some(t.elapsed().as_secs_f64() * 1e3);
            st.ended = if o.status.success() {
                "done".into()
            } else {
                format!("{}", o.status)
            };
            let text = String::from_utf8_lossy(&o.stdout);
            let resumed: Vec<u64> = text
                .lines()
                .filter_map(|l| l.split_once(" resumed from step ")?.1.parse().ok())
                .collect();
            st.resumed_from = resumed.first().copied();
            if !o.status.success() {
                rec.problems
                    .push(format!("the restart failed: {}", tail(&o)));
            }
            let all_same = match expected {
                Some(e) => resumed.len() == n as usize && resumed.iter().all(|s| *s == e),
                None => resumed.is_empty(),
            };
            if !all_same {
                rec.problems.push(format!(
                    "ranks resumed from {resumed:?}, the newest intact checkpoint is {expected:?}"
                ));
            }
            first.lost_steps = None;
            let got = std::fs::read(&out).unwrap_or_default();
            rec.final_identical = Some(got == want && !got.is_empty());
            if got != want {
                rec.problems
                    .push("final weights differ from the failure-free run".into());
            }
        }
        Err(e) => rec.problems.push(e),
    }
    rec.starts.push(first);
    rec.starts.push(st);
    rec.seconds = t0.elapsed().as_secs_f64();
    if rec.passed() {
        let _ = std::fs::remove_dir_all(&dir);
    }
    rec
}
