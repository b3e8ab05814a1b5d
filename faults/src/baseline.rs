//! The baseline of the campaign's restart figures: the victim's training state
//! restarted through libtorch's own serializer instead of ckpt
//! (`fault_victim --torch-baseline`: `Tensor::save_multi` then fsync, and in a
//! fresh process `Tensor::load_multi`, the copy into the model and one step).
//!
//! Same model, optimizer state and device as the campaign's tch job, timed the way
//! its restarts are: `load_ms` is the read alone (`load_multi`, as ckpt's is
//! `load_latest`), `recovery_ms` is the runner's clock from spawn to the first
//! `step` line. The page cache is warm for both: each restore reads a file that
//! other processes wrote or read shortly before, as each ckpt restart reads what
//! the killed process wrote; nothing is dropped from the cache. The restores run
//! between the campaign's runs ([`Runner`]).

use std::path::{Path, PathBuf};

use serde::Serialize;

use super::event::Event;
use super::plan::Kind;
use super::record::{RunRecord, Spread, StartRecord};
use super::victim::{self, Job, StartOut, Stop};

/// How the page cache stands, for the report.
pub const PAGE_CACHE: &str = "warm for both (files another process wrote or read shortly before)";

/// What the baseline measured.
#[derive(Debug, Clone, Default, Serialize)]
pub struct TorchBaseline {
    /// Restores timed.
    pub restores: usize,
    /// The step of the saved state.
    pub step: u64,
    /// Tensors in the file.
    pub tensors: usize,
    /// Bytes of the file.
    pub bytes: u64,
    /// `save_multi` and the fsyncs, ms.
    pub save_ms: f64,
    /// `load_multi` at each restore, ms.
    pub load_ms: Spread,
    /// Spawn to the first step at each restore, ms.
    pub recovery_ms: Spread,
}

/// ckpt's restarts beside the baseline, from the same campaign.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Comparison {
    /// ckpt: spawn to the first new step of the comparable restarts
    /// ([`comparable`]), ms.
    pub ckpt_recovery_ms: Spread,
    /// ckpt: `load_latest` at the same restarts, ms.
    pub ckpt_load_ms: Spread,
    /// The baseline.
    pub torch: TorchBaseline,
    /// Median restart to first step, ckpt / torch.
    pub recovery_ratio: Option<f64>,
    /// Median load, ckpt / torch.
    pub load_ratio: Option<f64>,
    /// How the page cache stood.
    pub page_cache: String,
}

/// The ckpt restarts that did what a baseline restore does: restarts of the tch
/// job that loaded a checkpoint and skipped none, on a store that injected no
/// faults (injected latency and retries, a damaged checkpoint skipped, or a
/// start from scratch would compare other work).
pub fn comparable(runs: &[RunRecord]) -> impl Iterator<Item = &StartRecord> {
    runs.iter()
        .filter(|r| r.job == "tch")
        .flat_map(|r| &r.starts)
        .filter(|st| {
            st.restart
                && st.resumed_from.is_some()
                && st.skipped.is_empty()
                && st.kind != Some(Kind::StoreFaults)
                && !st.loaded_damaged
        })
}

/// ckpt's comparable restarts of `runs` beside `torch`.
pub fn compare(runs: &[RunRecord], torch: TorchBaseline) -> Comparison {
    let starts: Vec<&StartRecord> = comparable(runs).collect();
    let ckpt_recovery_ms = Spread::of(starts.iter().filter_map(|s| s.recovery_ms).collect());
    let ckpt_load_ms = Spread::of(starts.iter().filter_map(|s| s.load_ms).collect());
    Comparison {
        recovery_ratio: ckpt_recovery_ms.ratio_to(&torch.recovery_ms),
        load_ratio: ckpt_load_ms.ratio_to(&torch.load_ms),
        ckpt_recovery_ms,
        ckpt_load_ms,
        torch,
        page_cache: PAGE_CACHE.to_owned(),
    }
}

/// The loss line of the step after the saved state.
fn loss_line(o: &StartOut, step: u64) -> Option<&String> {
    let prefix = format!("step {} ", step + 1);
    o.lines.iter().find(|l| l.starts_with(&prefix))
}

fn start(job: &Job, dir: &Path, file: &Path, mode: &str) -> Result<StartOut, String> {
    let args = [
        "--torch-baseline".to_owned(),
        mode.to_owned(),
        "--torch-file".to_owned(),
        file.display().to_string(),
    ];
    let o = victim::start(
        job,
        &dir.join("unused-root"),
        &dir.join("weights"),
        &dir.join("report.jsonl"),
        &[],
        &args,
        Stop::Never,
    )
    .map_err(|e| format!("running {} ({mode}): {e}", job.bin.display()))?;
    if o.code != Some(0) {
        return Err(format!(
            "the torch baseline's {mode} ended ({}): {:?}",
            o.ended(),
            o.error_event().map(|e| &e.error)
        ));
    }
    Ok(o)
}

/// The baseline through a campaign: the state saved once, then restored in a
/// fresh process after each tch run, so that its restores and ckpt's restarts
/// see the machine in the same state (load from other work drifts over a
/// campaign). Every restore must compute the same next step as the saving
/// process.
pub struct Runner {
    job: Job,
    dir: PathBuf,
    /// The save's figures and the loss line of the step after it.
    saved: Option<(TorchBaseline, String)>,
    load: Vec<f64>,
    recovery: Vec<f64>,
    error: Option<String>,
}

impl Runner {
    /// A baseline of `job` (at its last step) working in `dir`.
    pub fn new(job: Job, dir: PathBuf) -> Self {
        Runner {
            job,
            dir,
            saved: None,
            load: Vec::new(),
            recovery: Vec::new(),
            error: None,
        }
    }

    /// Restore once (saving first if nothing is saved yet). After an error,
    /// nothing: [`Runner::finish`] returns it.
    pub fn restore(&mut self) {
        if self.error.is_none() {
            if let Err(e) = self.try_restore() {
                self.error = Some(e);
            }
        }
    }

    fn file(&self) -> PathBuf {
        self.dir.join("state.pt")
    }

    fn save(&self) -> Result<(TorchBaseline, String), String> {
        let _ = std::fs::remove_dir_all(&self.dir);
        std::fs::create_dir_all(&self.dir)
            .map_err(|e| format!("creating {}: {e}", self.dir.display()))?;
        let o = start(&self.job, &self.dir, &self.file(), "save")?;
        let b = o
            .report
            .iter()
            .find_map(|e| match e {
                Event::TorchSave {
                    step,
                    tensors,
                    bytes,
                    save_ms,
                } => Some(TorchBaseline {
                    step: *step,
                    tensors: *tensors,
                    bytes: *bytes,
                    save_ms: *save_ms,
                    ..Default::default()
                }),
                _ => None,
            })
            .ok_or("the torch baseline's save reported no torch_save")?;
        let want = loss_line(&o, b.step)
            .ok_or("the torch baseline's save took no step after")?
            .clone();
        Ok((b, want))
    }

    fn try_restore(&mut self) -> Result<(), String> {
        if self.saved.is_none() {
            self.saved = Some(self.save()?);
        }
        let Some((b, want)) = &self.saved else {
            unreachable!("saved above")
        };
        let o = start(&self.job, &self.dir, &self.file(), "restore")?;
        let got = o.report.iter().find_map(|e| match e {
            Event::TorchLoad { step, load_ms, .. } => Some((*step, *load_ms)),
            _ => None,
        });
        let load_ms = match got {
            Some((step, ms)) if step == b.step => ms,
            other => return Err(format!("a torch restore reported {other:?}")),
        };
        if loss_line(&o, b.step) != Some(want) {
            return Err(format!(
                "a torch restore diverged: {:?}, the saving process {want:?}",
                loss_line(&o, b.step)
            ));
        }
        let first = o.first_step_ms.ok_or("a torch restore took no step")?;
        self.load.push(load_ms);
        self.recovery.push(first);
        Ok(())
    }

    /// Restore until there were at least `min` restores, remove the directory,
    /// and give the figures.
    pub fn finish(mut self, min: usize) -> Result<TorchBaseline, crate::error::Error> {
        while self.error.is_none() && self.load.len() < min {
            self.restore();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
        if let Some(e) = self.error {
            return Err(e.into());
        }
        let (mut b, _) = self.saved.ok_or("the torch baseline never ran")?;
        b.restores = self.load.len();
        b.load_ms = Spread::of(self.load);
        b.recovery_ms = Spread::of(self.recovery);
        Ok(b)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn start(kind: Option<Kind>, resumed: Option<u64>, ms: f64) -> StartRecord {
        StartRecord {
            kind,
            restart: true,
            resumed_from: resumed,
            recovery_ms: Some(ms),
            load_ms: Some(ms / 10.0),
            ..Default::default()
        }
    }

    #[test]
    fn only_clean_tch_restarts_are_compared() {
        let first = StartRecord {
            restart: false,
            ..start(None, Some(3), 1.0)
        };
        let tch = RunRecord {
            job: "tch".into(),
            starts: vec![
                first,
                start(Some(Kind::Kill), Some(3), 100.0),
                start(Some(Kind::StoreFaults), Some(6), 900.0),
                start(None, None, 5.0),
                start(Some(Kind::Crash), Some(9), 300.0),
            ],
            ..Default::default()
        };
        let mpi = RunRecord {
            job: "mpi-train".into(),
            starts: vec![start(None, Some(2), 5000.0)],
            ..Default::default()
        };
        let torch = TorchBaseline {
            restores: 3,
            load_ms: Spread::of(vec![4.0, 5.0, 6.0]),
            recovery_ms: Spread::of(vec![50.0, 100.0, 150.0]),
            ..Default::default()
        };
        let c = compare(&[tch, mpi], torch);
        assert_eq!(c.ckpt_recovery_ms.n, 2);
        assert_eq!(c.ckpt_recovery_ms.max, 300.0);
        assert_eq!(c.recovery_ratio, Some(3.0));
        assert_eq!(c.load_ratio, Some(30.0 / 5.0));
        let none = compare(&[], TorchBaseline::default());
        assert_eq!((none.recovery_ratio, none.load_ratio), (None, None));
    }
}
