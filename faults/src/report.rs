//! What a campaign found: per start, per run, and the summary users read.

use std::collections::BTreeMap;
use std::fmt::Write;

use serde::Serialize;

use super::baseline::Comparison;
use super::record::{RunRecord, Spread};

/// The campaign's summary.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Summary {
    /// Failures injected, by kind.
    pub failures: BTreeMap<String, u64>,
    /// Failures in all.
    pub failures_total: u64,
    /// Runs.
    pub runs: usize,
    /// Runs that passed.
    pub runs_passed: usize,
    /// Process starts, first starts included.
    pub starts: usize,
    /// Restarts (starts after a failure).
    pub restarts: usize,
    /// Restarts that found no intact checkpoint and started from scratch.
    pub restarts_from_scratch: usize,
    /// Saves in flight when the process died (torn saves).
    pub torn_saves: usize,
    /// Where the deaths of torn saves landed.
    pub torn_by_phase: BTreeMap<String, u64>,
    /// Restarts that loaded a torn or damaged checkpoint (must be 0).
    pub torn_or_damaged_loaded: usize,
    /// Restarts whose resume point or skipped list differed from the oracle (must be 0).
    pub wrong_resume: usize,
    /// Checkpoints skipped at restarts, by error class.
    pub skipped_by_kind: BTreeMap<String, u64>,
    /// Corruptions: applied, detected (a checkpoint needing the object was skipped),
    /// not needed (only older checkpoints or none needed it), removed (a deleted
    /// manifest took its checkpoint away), undetected (must be 0).
    pub corruptions: BTreeMap<String, u64>,
    /// Faults injected by the fault-injecting store, by kind.
    pub store_faults: BTreeMap<String, u64>,
    /// Saves that failed (storage faults, full disk), by cause.
    pub failed_saves: BTreeMap<String, u64>,
    /// Spawn to first new step after a failure, ms.
    pub recovery_ms: Spread,
    /// `load_latest` at restarts, ms.
    pub load_ms: Spread,
    /// Restarts beside the same state restarted through libtorch's serializer
    /// (`None`: not run; `not_run` says why).
    pub torch_baseline: Option<Comparison>,
    /// Work lost per failure, steps.
    pub lost_steps: Spread,
    /// Work lost in all, steps.
    pub lost_steps_total: u64,
    /// Final states compared with the failure-free run / identical.
    pub finals_compared: usize,
    /// Identical ones.
    pub finals_identical: usize,
    /// Zombie episodes: run, fenced (the old incarnation's saves were
    /// refused), zombie manifests found stored, zombie checkpoints loaded
    /// (must be 0), kept checkpoints damaged after a zombie ran (must be 0).
    pub zombies: BTreeMap<String, u64>,
    /// How the full disk was made.
    pub full_disk: String,
    /// Kinds that could not run, and why.
    pub not_run: Vec<(String, String)>,
    /// Wall time, seconds.
    pub seconds: f64,
    /// Every problem found, prefixed by its run.
    pub problems: Vec<String>,
}

/// A whole campaign.
#[derive(Debug, Clone, Serialize)]
pub struct CampaignReport {
    /// The command line's settings.
    pub config: serde_json::Value,
    /// The summary.
    pub summary: Summary,
    /// Every run.
    pub runs: Vec<RunRecord>,
}

impl CampaignReport {
    /// True when every run passed.
    pub fn passed(&self) -> bool {
        self.summary.problems.is_empty() && self.summary.runs_passed == self.summary.runs
    }
}

fn bump(m: &mut BTreeMap<String, u64>, k: impl Into<String>, n: u64) {
    *m.entry(k.into()).or_default() += n;
}

/// A short class of a save's error message.
pub fn save_failure_class(e: &str) -> &'static str {
    if e.contains("No space left") || e.contains("os error 28") {
        "no space left on device"
    } else if e.contains("already committed") || e.contains("already exists") {
        "step already committed (conflict)"
    } else if e.contains("injected timeout") || e.contains("timed out") {
        "storage timeout"
    } else if e.contains("injected partial") {
        "storage partial write"
    } else if e.contains("injected lost") {
        "storage lost acknowledgement"
    } else if e.contains("injected error") {
        "storage error"
    } else if e.contains("fenced") {
        "fenced (a zombie's save)"
    } else {
        "other"
    }
}

/// Gather the summary of finished runs.
pub fn summarize(runs: &[RunRecord], seconds: f64, full_disk: &str) -> Summary {
    let mut s = Summary {
        runs: runs.len(),
        seconds,
        full_disk: full_disk.to_owned(),
        ..Default::default()
    };
    let (mut rec, mut load, mut lost) = (Vec::new(), Vec::new(), Vec::new());
    for r in runs {
        if r.passed() {
            s.runs_passed += 1;
        }
        for p in &r.problems {
            s.problems.push(format!("run {} ({}): {p}", r.index, r.job));
        }
        for k in &r.failures {
            bump(&mut s.failures, k.name(), 1);
            s.failures_total += 1;
        }
        if let Some(same) = r.final_identical {
            s.finals_compared += 1;
            s.finals_identical += usize::from(same);
        }
        for st in &r.starts {
            s.starts += 1;
            if st.restart {
                s.restarts += 1;
                if st.resumed_from.is_none() && st.ended != "exit 1" {
                    s.restarts_from_scratch += 1;
                }
                rec.extend(st.recovery_ms);
                load.extend(st.load_ms);
            }
            if let Some(l) = st.lost_steps {
                lost.push(l as f64);
                s.lost_steps_total += l;
            }
            if let Some((_, phase)) = &st.torn {
                s.torn_saves += 1;
                bump(&mut s.torn_by_phase, phase.clone(), 1);
            }
            s.torn_or_damaged_loaded += usize::from(st.loaded_damaged);
            if let Some(z) = st.zombie_manifests {
                bump(&mut s.zombies, "episodes", 1);
                bump(
                    &mut s.zombies,
                    "old incarnation fenced",
                    u64::from(st.triggered),
                );
                bump(&mut s.zombies, "zombie manifests stored", z as u64);
            }
            for k in &st.skipped {
                bump(&mut s.skipped_by_kind, k.kind.clone(), 1);
            }
            for (_, e) in &st.failed_saves {
                bump(&mut s.failed_saves, save_failure_class(e), 1);
            }
            if let Some(f) = &st.store_faults {
                for (k, n) in [
                    ("errors", f.errors),
                    ("lost_acks", f.lost_acks),
                    ("partial", f.partial),
                    ("timeouts", f.timeouts),
                ] {
                    bump(&mut s.store_faults, k, n);
                }
            }
        }
        for (_, how) in &r.corruptions {
            bump(&mut s.corruptions, "applied", 1);
            bump(&mut s.corruptions, how.clone(), 1);
        }
    }
    s.wrong_resume = s
        .problems
        .iter()
        .filter(|p| p.contains("resumed from") || p.contains("skipped"))
        .count();
    if s.zombies.contains_key("episodes") {
        let count = |needle: &str| s.problems.iter().filter(|p| p.contains(needle)).count() as u64;
        let loaded = count("loaded the zombie's checkpoint");
        let damaged = count("damaged after the zombie ran");
        bump(&mut s.zombies, "zombie checkpoints loaded", loaded);
        bump(&mut s.zombies, "kept checkpoints damaged", damaged);
    }
    for k in ["detected", "not needed", "removed", "undetected"] {
        s.corruptions.entry(k.to_owned()).or_default();
    }
    s.recovery_ms = Spread::of(rec);
    s.load_ms = Spread::of(load);
    s.lost_steps = Spread::of(lost);
    s
}

/// ckpt's clean restarts beside the torch baseline's.
fn torch_table(t: &mut String, c: &Comparison) {
    let b = &c.torch;
    let _ = writeln!(
        t,
        "\nrestart beside torch save_multi/load_multi of the same state (median / p95 / max, ms)"
    );
    let _ = writeln!(
        t,
        "  {:<28} {:>26} {:>26} {:>12}",
        "", "ckpt", "torch", "ckpt/torch"
    );
    let cell = |x: &Spread| format!("{:.1} / {:.1} / {:.1}", x.median, x.p95, x.max);
    let ratio = |r: Option<f64>| r.map_or_else(|| "-".to_owned(), |r| format!("{r:.2}x"));
    for (k, ckpt, torch, r) in [
        (
            "restart to first new step",
            &c.ckpt_recovery_ms,
            &b.recovery_ms,
            c.recovery_ratio,
        ),
        ("load", &c.ckpt_load_ms, &b.load_ms, c.load_ratio),
    ] {
        let _ = writeln!(
            t,
            "  {k:<28} {:>26} {:>26} {:>12}",
            cell(ckpt),
            cell(torch),
            ratio(r)
        );
    }
    let _ = writeln!(
        t,
        "  {:<28} {:>26} {:>26}",
        "restarts timed", c.ckpt_recovery_ms.n, b.restores
    );
    let _ = writeln!(
        t,
        "  ckpt: tch restarts that loaded a checkpoint, skipped none, on a store without faults"
    );
    let _ = writeln!(
        t,
        "  torch: {} tensors, {} bytes at step {}, save_multi + fsync {:.1} ms",
        b.tensors, b.bytes, b.step, b.save_ms
    );
    let _ = writeln!(t, "  page cache: {}", c.page_cache);
}

/// The report as text (also the body of `faults.md`).
pub fn to_text(r: &CampaignReport) -> String {
    let s = &r.summary;
    let mut t = String::new();
    let _ = writeln!(
        t,
        "Fault campaign: {} failures in {} runs, {:.0} s ({})",
        s.failures_total,
        s.runs,
        s.seconds,
        r.config
            .as_object()
            .map(|m| m
                .iter()
                .map(|(k, v)| format!("{k}={v}"))
                .collect::<Vec<_>>()
                .join(" "))
            .unwrap_or_default()
    );
    let _ = writeln!(t, "\nfailures injected, by kind");
    for (k, n) in &s.failures {
        let _ = writeln!(t, "  {k:<36} {n:>6}");
    }
    let _ = writeln!(t, "  {:<36} {:>6}", "total", s.failures_total);
    let row = |t: &mut String, k: &str, v: String| {
        let _ = writeln!(t, "  {k:<36} {v:>6}");
    };
    let _ = writeln!(t, "\nrestarts");
    row(&mut t, "process starts", s.starts.to_string());
    row(&mut t, "restarts after a failure", s.restarts.to_string());
    row(
        &mut t,
        "restarts with no intact checkpoint",
        s.restarts_from_scratch.to_string(),
    );
    row(
        &mut t,
        "resume point or skip list != oracle",
        s.wrong_resume.to_string(),
    );
    let _ = writeln!(t, "\ntorn and corrupt checkpoints");
    row(&mut t, "saves torn by a death", s.torn_saves.to_string());
    for (k, n) in &s.torn_by_phase {
        row(&mut t, &format!("  died {k}"), n.to_string());
    }
    row(
        &mut t,
        "torn or damaged checkpoints loaded",
        s.torn_or_damaged_loaded.to_string(),
    );
    for (k, n) in &s.skipped_by_kind {
        row(&mut t, &format!("skipped at restart: {k}"), n.to_string());
    }
    for (k, n) in &s.corruptions {
        row(&mut t, &format!("corruptions {k}"), n.to_string());
    }
    if !s.zombies.is_empty() {
        let _ = writeln!(
            t,
            "\nzombies (an old incarnation resumed beside the new one)"
        );
        for (k, n) in &s.zombies {
            row(&mut t, k, n.to_string());
        }
    }
    if !s.store_faults.is_empty() || !s.failed_saves.is_empty() {
        let _ = writeln!(t, "\nstorage");
        for (k, n) in &s.store_faults {
            row(
                &mut t,
                &format!("store faults injected: {k}"),
                n.to_string(),
            );
        }
        for (k, n) in &s.failed_saves {
            row(&mut t, &format!("saves failed: {k}"), n.to_string());
        }
        row(&mut t, "full disk made by", s.full_disk.clone());
    }
    let _ = writeln!(t, "\nrecovery (median / p95 / max)");
    let sp = |t: &mut String, k: &str, x: &Spread, unit: &str| {
        let _ = writeln!(
            t,
            "  {k:<36} {:>8.1} / {:.1} / {:.1} {unit} (n = {})",
            x.median, x.p95, x.max, x.n
        );
    };
    sp(&mut t, "restart to first new step", &s.recovery_ms, "ms");
    sp(&mut t, "load_latest at restart", &s.load_ms, "ms");
    sp(&mut t, "work lost per failure", &s.lost_steps, "steps");
    row(
        &mut t,
        "work lost in all, steps",
        s.lost_steps_total.to_string(),
    );
    if let Some(c) = &s.torch_baseline {
        torch_table(&mut t, c);
    }
    let _ = writeln!(t, "\nverdict per run");
    let mut by_job: BTreeMap<&str, (usize, usize)> = BTreeMap::new();
    for run in &r.runs {
        let e = by_job.entry(run.job.as_str()).or_default();
        e.0 += 1;
        e.1 += usize::from(run.passed());
    }
    for (job, (n, ok)) in by_job {
        let _ = writeln!(t, "  {job:<36} {ok:>6} of {n} passed");
    }
    row(
        &mut t,
        "final states bitwise identical",
        format!("{} of {}", s.finals_identical, s.finals_compared),
    );
    for (k, why) in &s.not_run {
        let _ = writeln!(t, "  not run: {k} ({why})");
    }
    for p in s.problems.iter().take(30) {
        let _ = writeln!(t, "  PROBLEM {p}");
    }
    let _ = writeln!(t, "\nverdict: {}", if r.passed() { "PASS" } else { "FAIL" });
    t
}
