//! Recovery: what a restart after a crash costs. A short fault campaign of
//! `ckpt-faults` (SIGKILLs of its tch training job at random instants, inside
//! saves as well as between them): the time from spawning the restarted
//! process to its first new step and `load_latest` within it, beside the same
//! state restarted through libtorch's own serializer (`Tensor::save_multi` /
//! `load_multi`); and that no restart loaded a torn checkpoint or resumed
//! anywhere but where the on-disk oracle says.
//!
//! It needs the campaign's victim, `fault_victim`, which links libtorch (`cargo
//! build --release -p ckpt-faults --features victim`); without it, it is not run.

use std::path::PathBuf;

use ckpt_faults::plan::Kind;
use ckpt_faults::record::Spread;
use ckpt_faults::report::CampaignReport;
use ckpt_faults::CampaignConfig;

use super::{Ctx, Error, Experiment, Output, Target};
use crate::table::Table;

/// Options of the recovery experiment.
#[derive(clap::Args, Debug, Clone, Default)]
pub struct Recovery {
    /// Recovery: SIGKILLs of the training job [default: 6; --full: 30].
    #[arg(long)]
    pub recovery_kills: Option<u64>,
}

impl Recovery {
    fn kills(&self, ctx: &Ctx) -> u64 {
        self.recovery_kills
            .unwrap_or(if ctx.full { 30 } else { 6 })
            .max(1)
    }
}

fn victim() -> Option<PathBuf> {
    ckpt_faults::find_binary("fault_victim")
}

#[async_trait::async_trait]
impl Experiment for Recovery {
    fn name(&self) -> &'static str {
        "recovery"
    }

    fn about(&self, ctx: &Ctx) -> String {
        format!(
            "{} SIGKILLs of the tch job, its restarts beside libtorch's serializer",
            self.kills(ctx)
        )
    }

    fn estimate_s(&self, ctx: &Ctx) -> f64 {
        // Each run: a failure-free reference, the job through its kills, the
        // torch baseline; a few seconds a start.
        20.0 + 5.0 * self.kills(ctx) as f64
    }

    fn unavailable(&self, _ctx: &Ctx) -> Option<String> {
        victim().is_none().then(|| {
            "fault_victim is not built (source scripts/env.sh && cargo build --release -p ckpt-faults --features victim)".into()
        })
    }

    async fn run(&self, ctx: &Ctx) -> Result<Output, Error> {
        let victim = victim().ok_or("fault_victim is not built")?;
        let mut cfg = CampaignConfig::new(self.kills(ctx), 1, victim, ctx.fresh_dir("recovery")?);
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

/// The restart figures, the comparison with libtorch's serializer, and the
/// campaign's guarantees as targets.
pub fn render(r: &CampaignReport) -> Output {
    let s = &r.summary;
    let mut out = Output::of(s);
    let mut t = Table::new(
        "recovery",
        format!(
            "Recovery: {} SIGKILLs of the tch job over {} runs ({} restarts, {} of them from scratch); ms, median [95th percentile, max]",
            s.failures_total, s.runs, s.restarts, s.restarts_from_scratch
        ),
        &["figure", "ckpt ms", "libtorch ms", "ckpt / libtorch"],
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
