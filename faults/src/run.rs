//! One run of the tch job: a fresh root, a few failures from the plan, a restart
//! after each, and the final state compared with the failure-free run.

use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::time::Instant;

use ckpt_core::CheckpointId;

use super::event::Event;
use super::inject::{self, Corruption, Tmpfs};
use super::oracle::{self, Scan};
use super::plan::{self, Kind, Rng};
use super::record::{RunRecord, Skipped, StartRecord};
use super::victim::{self, Job, StartOut, Stop};
use super::zombie;

/// What every tch run of a campaign shares.
pub struct TchCtx {
    /// The job (its seed is set per run).
    pub job: Job,
    /// Where runs keep their roots.
    pub work: PathBuf,
    /// Whether a tmpfs can be mounted (`Err`: why not).
    pub can_mount: Result<(), String>,
    /// Final weights of the failure-free run, by training seed.
    pub references: HashMap<u64, Vec<u8>>,
}

/// Scan a root from synchronous code.
pub fn scan(root: &Path) -> Scan {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(oracle::scan(root)).unwrap_or_default()
}

impl TchCtx {
    /// The final weights of the failure-free run of `seed`.
    pub fn reference(&mut self, seed: u64) -> Result<Vec<u8>, crate::error::Error> {
        if let Some(w) = self.references.get(&seed) {
            return Ok(w.clone());
        }
        let dir = self.work.join(format!("reference-{seed}"));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
        let job = Job {
            seed,
            ..self.job.clone()
        };
        let out = dir.join("weights");
        let o = victim::start(
            &job,
            &dir.join("ckpt"),
            &out,
            &dir.join("report.jsonl"),
            &[],
            &[],
            Stop::Never,
        )
        .map_err(|e| format!("running {}: {e}", job.bin.display()))?;
        if !o.done {
            return Err(format!(
                "the failure-free run of seed {seed} did not finish: {}",
                o.ended()
            )
            .into());
        }
        let w = std::fs::read(&out).map_err(|e| e.to_string())?;
        let _ = std::fs::remove_dir_all(&dir);
        self.references.insert(seed, w.clone());
        Ok(w)
    }
}

fn id_str(id: &CheckpointId) -> String {
    format!("{}-{}", id.step, id.attempt)
}

/// Compare a start's report with the oracle; fill the record; list problems.
fn check_start(
    scan: &Scan,
    o: &StartOut,
    kind: Option<Kind>,
    st: &mut StartRecord,
    problems: &mut Vec<String>,
) -> Option<Option<CheckpointId>> {
    let expected = scan.newest_intact().map(|c| c.id.clone());
    st.expected_resume = expected.as_ref().map(|i| i.step);
    st.expected_skipped = scan.must_skip().len();
    let Some(Event::Start {
        resumed_from,
        attempt,
        load_ms,
        skipped,
        ..
    }) = o.start_event()
    else {
        let err = o.error_event();
        match (kind, err) {
            // A start on a faulty store may fail to list or read: it is retried.
            (Some(Kind::StoreFaults), Some(_)) => {}
            _ => problems.push(format!(
                "a start ended ({}) before reporting where it resumed: {:?}",
                o.ended(),
                err.map(|e| &e.error)
            )),
        }
        return None;
    };
    let resumed = resumed_from.map(|step| CheckpointId {
        step,
        attempt: attempt.clone().unwrap_or_default(),
    });
    st.resumed_from = resumed.as_ref().map(|i| i.step);
    st.load_ms = Some(*load_ms);
    st.skipped = skipped.clone();
    if let Some(r) = &resumed {
        let c = scan.committed.iter().find(|c| &c.id == r);
        if c.is_none_or(|c| c.damage.is_some()) {
            st.loaded_damaged = true;
            problems.push(format!(
                "loaded {} which is {}",
                id_str(r),
                c.and_then(|c| c.damage.clone())
                    .unwrap_or_else(|| "not committed".into())
            ));
        }
    }
    if resumed != expected {
        problems.push(format!(
            "resumed from {:?} but the newest intact checkpoint is {:?}",
            resumed.as_ref().map(id_str),
            expected.as_ref().map(id_str)
        ));
    }
    let got: BTreeSet<String> = st
        .skipped
        .iter()
        .map(|s| format!("{}-{}", s.step, s.attempt))
        .collect();
    let want: BTreeSet<String> = scan.must_skip().iter().map(id_str).collect();
    if got != want {
        problems.push(format!("skipped {got:?} but must skip {want:?}"));
    }
    Some(resumed)
}

/// How the start after a corruption dealt with it.
fn classify(c: &Corruption, resumed: &Option<CheckpointId>, skipped: &[Skipped]) -> &'static str {
    if resumed.as_ref().is_some_and(|r| c.affects.contains(r)) {
        return "undetected";
    }
    let newer = |id: &CheckpointId| resumed.as_ref().is_none_or(|r| id > r);
    let was_skipped = c.affects.iter().filter(|id| newer(id)).any(|id| {
        skipped
            .iter()
            .any(|s| s.step == id.step && s.attempt == id.attempt)
    });
    if was_skipped {
        "detected"
    } else if c.key.starts_with("manifests/") && c.action == plan::Action::Delete {
        "removed"
    } else {
        "not needed"
    }
}

/// Bytes on disk of the newest checkpoint (4 KiB blocks), for sizing a full disk.
fn newest_bytes(root: &Path, scan: &Scan) -> u64 {
    scan.newest()
        .map(|c| {
            c.objects
                .iter()
                .map(|k| {
                    std::fs::metadata(root.join(k))
                        .map(|m| m.len().div_ceil(4096) * 4096)
                        .unwrap_or(0)
                })
                .sum()
        })
        .filter(|b| *b > 0)
        .unwrap_or(200_000)
}

/// Run the tch job through `kinds` (none of them MPI), then to its end.
pub fn tch_run(ctx: &mut TchCtx, index: usize, rng: &mut Rng, kinds: &[Kind]) -> RunRecord {
    let t0 = Instant::now();
    let seed = 1000 + rng.range(0, 3);
    let mut rec = RunRecord {
        index,
        job: "tch".into(),
        detail: format!("seed {seed}"),
        ..Default::default()
    };
    let want = match ctx.reference(seed) {
        Ok(w) => w,
        Err(e) => {
            rec.problems.push(e.to_string());
            return rec;
        }
    };
    let job = Job {
        seed,
        ..ctx.job.clone()
    };
    let dir = ctx.work.join(format!("run-{index}"));
    let _ = std::fs::remove_dir_all(&dir);
    if let Err(e) = std::fs::create_dir_all(&dir) {
        rec.problems
            .push(format!("creating {}: {e}", dir.display()));
        return rec;
    }
    let tmpfs = match (kinds.contains(&Kind::DiskFull), &ctx.can_mount) {
        (true, Ok(())) => match Tmpfs::mount(&dir.join("mnt"), 32) {
            Ok(t) => Some(t),
            Err(e) => {
                ctx.can_mount = Err(e.to_string());
                None
            }
        },
        _ => None,
    };
    let root = tmpfs
        .as_ref()
        .map_or_else(|| dir.join("ckpt"), |t| t.dir.join("ckpt"));
    let out = dir.join("weights");
    let report = dir.join("report.jsonl");

    let mut pending: Vec<Corruption> = Vec::new();
    let mut restart = false;
    let mut plan: Vec<Option<Kind>> = kinds.iter().copied().map(Some).collect();
    plan.push(None);
    let mut finished = false;
    for planned in plan {
        let mut before = scan(&root);
        let resume = before.newest_intact().map_or(0, |c| c.id.step);
        let mut kind = planned;
        if kind.is_some() && resume >= job.steps {
            // The job is complete: nothing left to interrupt.
            kind = None;
        }
        if kind == Some(Kind::Corrupt) {
            let (target, action) = plan::corruption(rng);
            match inject::corrupt(&root, &before, rng, target, action) {
                Ok(Some(c)) => {
                    rec.failures.push(Kind::Corrupt);
                    pending.push(c);
                    restart = true;
                    continue;
                }
                // Nothing stored yet: kill instead.
                _ => kind = Some(Kind::Kill),
            }
        }
        let remaining_saves = (job.steps - resume) / job.every.max(1);
        let mut env: Vec<(String, String)> = Vec::new();
        let mut args: Vec<String> = Vec::new();
        let mut ballast: Option<PathBuf> = None;
        let mut point: Option<&str> = None;
        let kill_step = |rng: &mut Rng| Stop::AtStep {
            step: rng.range(resume + 1, job.steps.saturating_sub(1).max(resume + 1)),
            delay_us: rng.range(0, 3000),
        };
        let (stop, detail) = match kind {
            None => (Stop::Never, String::new()),
            Some(Kind::Kill) => {
                let s = kill_step(rng);
                (s, format!("{s:?}"))
            }
            Some(k @ (Kind::Crash | Kind::Parked)) => {
                let p = *rng.pick(plan::SAVE_POINTS);
                let save_n = rng.range(1, remaining_saves.max(1));
                let nth = if p == "save.mid_data" {
                    // About 18 objects per save (6 parameters, 12 Adam moments).
                    (save_n - 1) * 18 + rng.range(1, 18)
                } else if p == "gc.before_delete" {
                    rng.range(1, save_n.max(1))
                } else {
                    save_n
                };
                point = Some(p);
                let action = if k == Kind::Crash {
                    "abort"
                } else {
                    "sleep(60000)"
                };
                let spec = format!("{p}={nth}*{action}");
                env.push(("CKPT_FAILPOINTS".into(), spec.clone()));
                let stop = if k == Kind::Crash {
                    Stop::Never
                } else {
                    Stop::OnSilence { ms: 400 }
                };
                (stop, spec)
            }
            Some(Kind::StoreFaults) => {
                let rate = *rng.pick(&[0.05, 0.1, 0.2, 0.3]);
                let fseed = rng.next_u64() >> 1;
                args.extend(["--store-faults".into(), format!("{fseed}:{rate}")]);
                let s = kill_step(rng);
                (s, format!("rate {rate}, {s:?}"))
            }
            Some(Kind::DiskFull) => {
                let stop = Stop::AfterSaveFailure {
                    extra: rng.range(0, 3),
                    fallback: job.steps.saturating_sub(1),
                };
                match &tmpfs {
                    Some(t) => {
                        let leave = rng.range(0, newest_bytes(&root, &before) * 3 / 4);
                        match t.fill(leave) {
                            Ok(p) => ballast = Some(p),
                            Err(e) => rec.problems.push(format!("ballast: {e}")),
                        }
                        (stop, format!("tmpfs with {leave} bytes free"))
                    }
                    None => {
                        args.extend([
                            "--store-faults".into(),
                            format!("{}:full", rng.next_u64() >> 1),
                        ]);
                        (stop, "every write fails (FaultStore)".into())
                    }
                }
            }
            // Its own supervision below.
            Some(Kind::Zombie) => (Stop::Never, String::new()),
            Some(Kind::Corrupt | Kind::MpiRank | Kind::MpiTrain) => unreachable!(),
        };
        let mut zombie_fenced = false;
        let mut zombie_manifests = None;
        let mut detail = detail;
        let started = if kind == Some(Kind::Zombie) {
            zombie::episode(&job, &root, &dir, &out, &report, rng, resume).map(|ep| {
                rec.problems.extend(ep.problems);
                before = ep.before_new;
                detail = ep.detail;
                zombie_fenced = ep.triggered;
                zombie_manifests = Some(ep.zombie_manifests);
                ep.new
            })
        } else {
            victim::start(&job, &root, &out, &report, &env, &args, stop)
        };
        let o = match started {
            Ok(o) => o,
            Err(e) => {
                rec.problems.push(format!("running the job: {e}"));
                break;
            }
        };
        if let Some(b) = ballast {
            let _ = std::fs::remove_file(b);
        }
        let mut st = StartRecord {
            kind,
            detail,
            // The new incarnation beside a frozen one is a restart too.
            restart: restart || kind == Some(Kind::Zombie),
            recovery_ms: o.first_step_ms.filter(|_| restart),
            reached: o.reached,
            ended: o.ended(),
            failed_saves: o.failed_saves.clone(),
            store_faults: o.faults().copied(),
            zombie_manifests,
            ..Default::default()
        };
        if o.hung {
            rec.problems
                .push(format!("the job hung: {:?}", o.lines.last()));
        }
        let resumed = check_start(&before, &o, kind, &mut st, &mut rec.problems);
        if let Some(resumed) = &resumed {
            if let Some(prev) = rec.starts.last_mut() {
                if prev.ended != "done" {
                    prev.lost_steps = Some(
                        prev.reached
                            .saturating_sub(resumed.as_ref().map_or(0, |r| r.step)),
                    );
                }
            }
            for c in pending.drain(..) {
                let how = classify(&c, resumed, &st.skipped);
                if how == "undetected" {
                    rec.problems
                        .push(format!("corruption of `{}` was not detected", c.key));
                }
                rec.corruptions.push((c, how.to_owned()));
            }
        }
        // Where a death inside a save landed, and whether the commit rule held.
        if let (Some(x), false) = (o.in_flight, o.done) {
            let after = scan(&root);
            let new: Vec<CheckpointId> = after
                .ids()
                .difference(&before.ids())
                .filter(|i| i.step == x)
                .cloned()
                .collect();
            let committed = !new.is_empty();
            let phase = match point {
                Some(p) if plan::before_commit(p) && committed => {
                    rec.problems.push(format!(
                        "step {x} was committed although the process died at {p}, before its manifest"
                    ));
                    p.to_owned()
                }
                Some(p) if !plan::before_commit(p) && !committed => {
                    if kind == Some(Kind::Crash) {
                        rec.problems.push(format!(
                            "step {x} is not committed although the process died at {p}, after its manifest"
                        ));
                    }
                    format!("{p} (killed before reaching it)")
                }
                Some(p) => p.to_owned(),
                None if committed => "at a random instant, after the manifest".into(),
                None => "at a random instant, before the manifest".into(),
            };
            st.torn = Some((x, phase));
        }
        let triggered = match kind {
            None => false,
            Some(Kind::Kill) | Some(Kind::Parked) => o.killed,
            Some(Kind::Crash) => o.signal == Some(6),
            Some(Kind::StoreFaults) => o.faults().is_some_and(|f| f.total() > 0),
            Some(Kind::DiskFull) => !o.failed_saves.is_empty(),
            Some(Kind::Zombie) => zombie_fenced,
            Some(_) => false,
        };
        st.triggered = triggered;
        match kind {
            Some(k) if triggered => rec.failures.push(k),
            // A full disk that was never reached still ended in a SIGKILL.
            Some(Kind::DiskFull) | Some(Kind::StoreFaults) if o.killed => {
                rec.failures.push(Kind::Kill)
            }
            _ => {}
        }
        restart = !o.done;
        rec.starts.push(st);
        if o.done {
            finished = true;
            if o.reached < job.steps && resumed.flatten().map(|r| r.step) != Some(job.steps) {
                rec.problems.push(format!(
                    "done at step {} without reaching {}",
                    o.reached, job.steps
                ));
            }
            break;
        }
    }
    if finished {
        match std::fs::read(&out) {
            Ok(got) => {
                rec.final_identical = Some(got == want);
                if got != want {
                    rec.problems
                        .push("final weights differ from the failure-free run".into());
                }
            }
            Err(e) => rec.problems.push(format!("no final weights: {e}")),
        }
    } else if rec.problems.is_empty() {
        rec.problems.push("the job never finished".into());
    }
    rec.seconds = t0.elapsed().as_secs_f64();
    drop(tmpfs);
    if rec.passed() {
        let _ = std::fs::remove_dir_all(&dir);
    }
    rec
}
