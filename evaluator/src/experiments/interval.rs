//! Interval: how often to checkpoint. From the costs measured in this run (the
//! stall per save of each setup in the overhead experiment, the load time of
//! the matching format as the restart cost) and a given MTBF, the Young/Daly
//! optimal interval and the expected goodput of each setup, plus the goodput
//! curve over a range of intervals (for the plot).

use serde::Serialize;

use super::formats::FormatResults;
use super::overhead::OverheadResults;
use super::{Ctx, Error, Experiment, Output};
use crate::interval::{goodput, plan, Plan};
use crate::plot::Chart;
use crate::table::Table;

/// Settings of the interval experiment.
#[derive(Debug, Clone)]
pub struct IntervalBench {
    /// Mean time between failures, seconds.
    pub mtbf_s: f64,
    /// Fixed part of the restart cost (rescheduling, process start), seconds.
    pub restart_fixed_s: f64,
}

/// One setup's plan and goodput curve.
#[derive(Debug, Clone, Serialize)]
pub struct IntervalRow {
    /// The plan (cost, Young, Daly, goodput at Daly).
    pub plan: Plan,
    /// Restart cost used (fixed part + load time), seconds.
    pub restart_s: f64,
    /// (interval seconds, goodput) over a log-spaced range.
    pub curve: Vec<(f64, f64)>,
}

/// Results of the interval experiment.
#[derive(Debug, Clone, Serialize)]
pub struct IntervalResults {
    /// MTBF, seconds.
    pub mtbf_s: f64,
    /// One row per setup.
    pub rows: Vec<IntervalRow>,
}

/// Which load time stands for the restart of an overhead setup.
fn restart_source(setup: &str) -> &'static str {
    if setup.starts_with("dcp") {
        "dcp.save"
    } else if setup.starts_with("torch") {
        "torch.save"
    } else {
        "ckpt native"
    }
}

/// `n` log-spaced points from `lo` to `hi`.
pub fn log_space(lo: f64, hi: f64, n: usize) -> Vec<f64> {
    if n < 2 {
        return vec![lo];
    }
    let (a, b) = (lo.ln(), hi.ln());
    (0..n)
        .map(|i| (a + (b - a) * i as f64 / (n - 1) as f64).exp())
        .collect()
}

impl IntervalBench {
    /// Plans for every checkpointing setup of `overhead`, restart costs from `formats`.
    pub fn run(
        &self,
        overhead: &OverheadResults,
        formats: Option<&FormatResults>,
    ) -> IntervalResults {
        let mut rows = Vec::new();
        for r in overhead.rows.iter().skip(1) {
            let load = formats
                .and_then(|f| f.rows.iter().find(|x| x.name == restart_source(&r.name)))
                .map_or(0.0, |x| x.load_s.median);
            let restart = self.restart_fixed_s + load;
            let cost = r.stall_s.median;
            let p = plan(&r.name, cost, restart, self.mtbf_s);
            let curve = log_space((cost.max(1e-3)) * 2.0, self.mtbf_s / 2.0, 40)
                .into_iter()
                .map(|t| (t, goodput(t, cost, restart, self.mtbf_s)))
                .collect();
            rows.push(IntervalRow {
                plan: p,
                restart_s: restart,
                curve,
            });
        }
        IntervalResults {
            mtbf_s: self.mtbf_s,
            rows,
        }
    }
}

/// Options of the interval experiment (it reads the formats and overhead results).
#[derive(clap::Args, Debug, Clone, Default)]
pub struct Interval {
    /// Interval: mean time between failures, seconds [default: 3600].
    #[arg(long)]
    pub mtbf: Option<f64>,
    /// Interval: fixed restart cost (before loading), seconds [default: 60].
    #[arg(long)]
    pub restart: Option<f64>,
}

#[async_trait::async_trait]
impl Experiment for Interval {
    fn name(&self) -> &'static str {
        "interval"
    }

    fn about(&self, _ctx: &Ctx) -> String {
        format!(
            "Young/Daly for an MTBF of {:.0} s from this run's costs",
            self.mtbf.unwrap_or(3600.0)
        )
    }

    fn estimate_s(&self, _ctx: &Ctx) -> f64 {
        0.0
    }

    fn needs(&self) -> &'static [&'static str] {
        &["formats", "overhead"]
    }

    async fn run(&self, ctx: &Ctx) -> Result<Output, Error> {
        let o = ctx
            .kept::<OverheadResults>()
            .ok_or("needs the overhead results, which are missing (it failed or did not run)")?;
        let f = ctx.kept::<FormatResults>();
        let iv = IntervalBench {
            mtbf_s: self.mtbf.unwrap_or(3600.0),
            restart_fixed_s: self.restart.unwrap_or(60.0),
        }
        .run(&o, f.as_ref());
        let mut out = Output::of(&iv);
        out.tables.push(table(&iv));
        out.charts.push(("interval_goodput".into(), chart(&iv)));
        Ok(out)
    }
}

/// The interval table.
pub fn table(iv: &IntervalResults) -> Table {
    let mut t = Table::new(
        "interval",
        format!("Checkpoint interval for MTBF {:.0} s (cost = stall per save; restart = fixed + load time)", iv.mtbf_s),
        &["setup", "cost s", "restart s", "Young s", "Daly s", "goodput at Daly"],
    );
    for x in &iv.rows {
        t.rows.push(vec![
            x.plan.setup.clone(),
            format!("{:.4}", x.plan.cost_s),
            format!("{:.3}", x.restart_s),
            format!("{:.1}", x.plan.young_s),
            format!("{:.1}", x.plan.daly_s),
            format!("{:.5}", x.plan.goodput),
        ]);
    }
    t
}

/// Goodput by interval, one line per setup.
pub fn chart(iv: &IntervalResults) -> Chart {
    Chart::Lines {
        title: format!(
            "Expected goodput by checkpoint interval (MTBF {:.0} s)",
            iv.mtbf_s
        ),
        x_label: "interval between checkpoints (s)".into(),
        y_label: "goodput".into(),
        log_x: true,
        series: iv
            .rows
            .iter()
            .map(|x| (x.plan.setup.clone(), x.curve.clone()))
            .collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn log_space_by_hand() {
        let v = log_space(1.0, 100.0, 3);
        assert!(
            (v[0] - 1.0).abs() < 1e-12 && (v[1] - 10.0).abs() < 1e-9 && (v[2] - 100.0).abs() < 1e-9
        );
        assert_eq!(log_space(5.0, 9.0, 1), vec![5.0]);
        assert_eq!(restart_source("dcp.async_save"), "dcp.save");
        assert_eq!(restart_source("ckpt lazy"), "ckpt native");
    }
}
