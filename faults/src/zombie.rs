//! A zombie episode: the job is frozen (SIGSTOP) at a random instant, a new
//! incarnation starts on the same root, and the frozen one is resumed
//! (SIGCONT) right after the new one claimed the root, while it trains, saves
//! and collects. The old one goes on training and saving to the end.
//!
//! What must hold (checked here; the run's usual checks come on top):
//! - the old incarnation's saves after the claim fail as fenced;
//! - every checkpoint the root keeps is intact (no chunk the new incarnation
//!   references was deleted by the old one's GC);
//! - a start after both ended resumes from the newest valid checkpoint, never
//!   from one the old incarnation committed after the claim.

use std::path::Path;
use std::time::{Duration, Instant};

use super::oracle::Scan;
use super::plan::Rng;
use super::run::scan;
use super::victim::{self, Job, Running, StartOut, Stop};

/// What an episode did.
pub struct Episode {
    /// The new incarnation's start (it runs to the end).
    pub new: StartOut,
    /// The root as the new incarnation found it.
    pub before_new: Scan,
    /// Parameters, and what happened, in words.
    pub detail: String,
    /// The old incarnation was frozen, resumed while the new one ran, and
    /// fenced at a save.
    pub triggered: bool,
    /// Everything that contradicts the guarantees.
    pub problems: Vec<String>,
    /// Manifests the old incarnation committed after it was fenced.
    pub zombie_manifests: usize,
}

fn claims(root: &Path) -> usize {
    std::fs::read_dir(root.join("epochs")).map_or(0, |d| d.count())
}

/// Run one episode on `root`, resuming from step `resume`.
pub fn episode(
    job: &Job,
    root: &Path,
    dir: &Path,
    out: &Path,
    report: &Path,
    rng: &mut Rng,
    resume: u64,
) -> std::io::Result<Episode> {
    let every = job.every.max(1);
    // Frozen early enough that a save of its own comes after it is resumed.
    let last = job.steps.saturating_sub(every + 1).max(resume + 1);
    let step = rng.range(resume + 1, last);
    let delay_us = rng.range(0, 3000);
    let wake_ms = rng.range(0, 400);
    // Half the episodes freeze the old incarnation inside its first save,
    // after it checked its epoch and before it publishes (parked at the
    // failpoint): resumed, it publishes after the new claim, the race the
    // fence's check after publishing is for.
    let parked = rng.range(0, 1) == 1;
    let (env, stop, how) = if parked {
        (
            vec![(
                "CKPT_FAILPOINTS".to_owned(),
                "save.before_manifest=1*sleep(3000)".to_owned(),
            )],
            Stop::FreezeOnSilence { ms: 300 },
            "inside its first save, before the manifest".to_owned(),
        )
    } else {
        (
            Vec::new(),
            Stop::Freeze { step, delay_us },
            format!("(+{delay_us} us)"),
        )
    };
    let mut problems = Vec::new();
    let mut old = Running::spawn(
        job,
        root,
        &dir.join("zombie-weights"),
        &dir.join("zombie-report.jsonl"),
        &env,
        &[],
    )?;
    old.supervise(stop);
    let frozen_at = old.reached();
    let before_new = scan(root);
    let claims_before = claims(root);

    // Resume the old incarnation once the new one has claimed the root.
    let pid = old.pid();
    let watch_root = root.to_owned();
    let watcher = std::thread::spawn(move || {
        let t = Instant::now();
        while claims(&watch_root) <= claims_before && t.elapsed() < Duration::from_secs(60) {
            std::thread::sleep(Duration::from_millis(2));
        }
        let claimed = claims(&watch_root) > claims_before;
        std::thread::sleep(Duration::from_millis(wake_ms));
        // The old incarnation is not reaped before `finish` below.
        victim::send_signal(pid, libc::SIGCONT);
        claimed
    });
    let new = victim::start(job, root, out, report, &[], &[], Stop::Never)?;
    let claimed = watcher.join().unwrap_or(false);
    old.signal(libc::SIGCONT);
    old.supervise(Stop::Never);
    let old = old.finish()?;

    let fenced: Vec<u64> = old
        .failed_saves
        .iter()
        .filter(|(_, why)| why.contains("fenced"))
        .map(|(s, _)| *s)
        .collect();
    let other_failures = old.failed_saves.len() - fenced.len();
    if !claimed {
        problems.push("the new incarnation never claimed the root".into());
    }
    if old.hung {
        problems.push("the old incarnation hung after it was resumed".into());
    }
    if old.done && fenced.is_empty() && old.reached > frozen_at + every {
        problems.push(format!(
            "the old incarnation saved after the new one claimed the root and was never fenced \
             (frozen at step {frozen_at}, reached {})",
            old.reached
        ));
    }
    if other_failures > 0 {
        problems.push(format!(
            "the old incarnation's saves failed other than as fenced: {:?}",
            old.failed_saves
        ));
    }

    // Everything kept is intact, and a start now resumes from a valid checkpoint.
    let after = scan(root);
    for c in &after.committed {
        if let Some(d) = &c.damage {
            problems.push(format!(
                "kept checkpoint {} is damaged after the zombie ran: {d}",
                c.id
            ));
        }
    }
    let check = victim::start(
        job,
        root,
        &dir.join("check-weights"),
        report,
        &[],
        &[],
        Stop::Never,
    )?;
    let resumed = check.start_event().and_then(|e| match e {
        super::event::Event::Start {
            resumed_from,
            attempt,
            ..
        } => Some((*resumed_from, attempt.clone())),
        _ => None,
    });
    let expected = after
        .newest_intact()
        .map(|c| (c.id.step, c.id.attempt.clone()));
    match resumed {
        Some((step, attempt)) => {
            let got = step.map(|s| (s, attempt.unwrap_or_default()));
            if after
                .zombies
                .iter()
                .any(|z| Some((z.step, z.attempt.clone())) == got)
            {
                problems.push(format!("a start loaded the zombie's checkpoint {got:?}"));
            } else if got != expected {
                problems.push(format!(
                    "a start after the zombie resumed from {got:?}, not the newest valid {expected:?}"
                ));
            }
        }
        None => problems.push(format!(
            "the check start reported no start ({})",
            check.ended()
        )),
    }
    let detail = format!(
        "frozen at step {frozen_at} {how}, resumed {wake_ms} ms after the new claim; \
         its saves fenced at steps {fenced:?}; {} zombie manifest(s) on the root",
        after.zombies.len()
    );
    Ok(Episode {
        new,
        before_new,
        detail,
        triggered: claimed && !fenced.is_empty(),
        problems,
        zombie_manifests: after.zombies.len(),
    })
}
