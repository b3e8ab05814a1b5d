//! Recovery: what a restart after a crash costs. A short fault campaign of
//! `ckpt-faults` (SIGKILLs of a PyTorch training job at random instants, inside
//! saves as well as between them): the time from spawning the restarted
//! process to its first new step and `load_latest` within it, beside the same
//! state restarted through `torch.save` / `torch.load(weights_only=True)`; and
//! that no restart loaded a torn checkpoint or resumed anywhere but where the
//! on-disk oracle says.
//!
//! The job is `evaluator/python/recovery_victim.py`, which checkpoints through
//! the `ckpt` Python package as a user's loop does and speaks the campaign's
//! victim protocol (the Rust `fault_victim`, which links libtorch, serves the
//! campaigns that also inject store faults). It needs the venv's torch and ckpt.

use std::path::PathBuf;

use ckpt_faults::plan::Kind;
use ckpt_faults::record::Spread;
use ckpt_faults::report::CampaignReport;
use ckpt_faults::CampaignConfig;

use super::script::python_missing;
use super::{Ctx, Error, Experiment, Output, Target};
use crate::table::Table;

/// Options of the recovery experiment.
#[derive(clap::Args, Debug, Clone, Default)]
pub struct Recovery {
    /// Recovery: SIGKILLs of the training job [default: 3; --full: 30].
    #[arg(long)]
    pub recovery_kills: Option<u64>,
}

impl Recovery {
    fn kills(&self, ctx: &Ctx) -> u64 {
        self.recovery_kills
            .unwrap_or(if ctx.full { 30 } else { 3 })
            .max(1)
    }
}

/// The victim script: `CKPT_EVAL_RECOVERY_VICTIM`, else the source tree's.
fn victim() -> PathBuf {
    crate::python::source_path("CKPT_EVAL_RECOVERY_VICTIM", "python/recovery_victim.py")
}

#[async_trait::async_trait]
impl Experiment for Recovery {
    fn name(&self) -> &'static str {
        "recovery"
    }

    fn about(&self, ctx: &Ctx) -> String {
        format!(
            "{} SIGKILLs of a PyTorch training job, its restarts beside torch.save's",
            self.kills(ctx)
        )
    }

    fn estimate_s(&self, ctx: &Ctx) -> f64 {
        // Each run: a failure-free reference, the job through its kills, the
        // torch baseline; about 3 s a start (most of it importing torch).
        20.0 + 6.0 * self.kills(ctx) as f64
    }

    fn unavailable(&self, ctx: &Ctx) -> Option<String> {
        let script = victim();
        if !script.exists() {
            return Some(format!("its script {} is absent", script.display()));
        }
        python_missing(ctx.python.as_deref(), "torch, ckpt")
    }

    async fn run(&self, ctx: &Ctx) -> Result<Output, Error> {
        let python = ctx.python.clone().ok_or("no Python interpreter")?;
        let mut cfg = CampaignConfig::new(self.kills(ctx), 1, python, ctx.fresh_dir("recovery")?);
        cfg.victim_args = vec![victim().display().to_string()];
        cfg.kinds = vec![Kind::Kill];
        cfg.progress = false;
        let report = tokio::task::spawn_blocking(move || ckpt_faults::campaign(&cfg))
            .await?
            .map_err(|e| Error::Failed(format!("the campaign failed: {e}")))?;
        Ok(render(&report))
    }
}

fn spread(s: &Spread) -> String {
    format!("{:.0} [p95 {:.0}, max {:.0}]", s.median, s.p95, s.max)
}

/// The restart figures, the comparison with torch.save, and the
/// campaign's guarantees as targets.
pub fn render(r: &CampaignReport) -> Output {
    let s = &r.summary;
    let mut out = Output::of(s);
    let mut t = Table::new(
        "recovery",
        format!(
            "Recovery: {} SIGKILLs of the PyTorch job over {} runs ({} restarts, {} of them from scratch); ms, median [95th percentile, max]",
            s.failures_total, s.runs, s.restarts, s.restarts_from_scratch
        ),
        &["figure", "ckpt ms", "torch.save ms", "ckpt / torch.save"],
    );
    let ratio = |r: Option<f64>| r.map_or_else(String::new, |x| format!("{x:.2}"));
    match &s.torch_baseline {
        Some(c) => {
            t.rows.push(vec![
                "restart: spawn to first new step".into(),
                spread(&c.ckpt_recovery_ms),
                spread(&c.torch.recovery_ms),
                ratio(c.recovery_ratio),
            ]);
            t.rows.push(vec![
                "load at restart".into(),
                spread(&c.ckpt_load_ms),
                spread(&c.torch.load_ms),
                ratio(c.load_ratio),
            ]);
        }
        None => {
            t.rows.push(vec![
                "restart: spawn to first new step".into(),
                spread(&s.recovery_ms),
                String::new(),
                String::new(),
            ]);
            t.rows.push(vec![
                "load at restart".into(),
                spread(&s.load_ms),
                String::new(),
                String::new(),
            ]);
        }
    }
    t.rows.push(vec![
        "work lost per kill, steps".into(),
        spread(&s.lost_steps),
        String::new(),
        String::new(),
    ]);
    out.tables.push(t);
    out.targets = vec![
        Target::new(
            "restarts that loaded a torn or damaged checkpoint",
            s.torn_or_damaged_loaded as f64,
            0.0,
        ),
        Target::new(
            "restarts not where the on-disk oracle says",
            s.wrong_resume as f64,
            0.0,
        ),
        Target::new(
            "runs whose final state differs from the failure-free run",
            (s.finals_compared - s.finals_identical) as f64,
            0.0,
        ),
    ];
    out.notes = s
        .not_run
        .iter()
        .map(|(what, why)| format!("recovery: {what} not run: {why}"))
        .chain(s.problems.iter().map(|p| format!("recovery: PROBLEM: {p}")))
        .collect();
    out
}
