//! Overhead: what checkpointing every k steps costs a training loop.
//!
//! The loop emulates accelerator training: each step the host waits `compute`
//! (forward and backward run on the device, the host is idle), then the
//! optimizer step mutates every parameter buffer (so every checkpoint is new),
//! then every `every` steps a checkpoint is taken:
//!
//! - `blocking`: `save` then `wait` (the loop waits until durable);
//! - `eager async`: `save` returns after the snapshot copy, persisting overlaps training;
//! - `lazy`: `save` returns at once; the copy overlaps the next forward/backward,
//!   and the loop calls `wait_snapshot` before the next optimizer step;
//! - the Python baselines `torch.save` (blocking, fsync) and `dcp.async_save`.
//!
//! Reported: stall per save (time the loop was held by checkpointing), slowdown
//! of the loop against the same loop without checkpoints, peak extra memory.

use std::time::{Duration, Instant};

use ckpt_core::{SaveHandle, SnapshotMode, State};
use serde::Serialize;

use super::{file_url, Ctx, Error, Experiment, Output};
use crate::plot::{bar, Chart};
use crate::python;
use crate::rss::{rss_bytes, PeakSampler};
use crate::stats::Summary;
use crate::table::{mib, secs, Table};
use crate::workload::Params;

/// How the loop checkpoints.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum Mode {
    /// No checkpoints (the reference).
    None,
    /// `save` + `wait`.
    Blocking,
    /// Eager snapshot, persist in the background.
    EagerAsync,
    /// Lazy snapshot, persist in the background.
    Lazy,
}

impl Mode {
    /// Display name.
    pub fn name(self) -> &'static str {
        match self {
            Mode::None => "no checkpoints",
            Mode::Blocking => "ckpt blocking",
            Mode::EagerAsync => "ckpt eager async",
            Mode::Lazy => "ckpt lazy",
        }
    }
}

/// Settings of the overhead experiment.
#[derive(Debug, Clone)]
pub struct OverheadBench {
    /// Training steps per run.
    pub steps: u64,
    /// Checkpoint every this many steps.
    pub every: u64,
    /// Emulated compute per step.
    pub compute: Duration,
}

/// One setup, measured.
#[derive(Debug, Clone, Serialize)]
pub struct OverheadRow {
    /// Setup name.
    pub name: String,
    /// Loop time per run, seconds.
    pub loop_s: Summary,
    /// Stall per save, seconds (every save of every run).
    pub stall_s: Summary,
    /// Slowdown of the loop against the same loop without checkpoints, percent.
    pub slowdown_pct: f64,
    /// Peak extra resident memory during the runs, bytes.
    pub peak_extra_bytes: u64,
}

/// Results of the overhead experiment.
#[derive(Debug, Clone, Serialize)]
pub struct OverheadResults {
    /// Raw bytes of the state.
    pub state_bytes: u64,
    /// Steps per run.
    pub steps: u64,
    /// Checkpoint interval in steps.
    pub every: u64,
    /// Emulated compute per step, seconds.
    pub compute_s: f64,
    /// One row per setup; the first is the loop without checkpoints.
    pub rows: Vec<OverheadRow>,
    /// Why the Python baselines are missing, if they are.
    pub python_error: Option<String>,
}

/// Slowdown in percent of `loop_s` against `reference_s`.
pub fn slowdown_pct(loop_s: f64, reference_s: f64) -> f64 {
    if reference_s <= 0.0 {
        return 0.0;
    }
    (loop_s / reference_s - 1.0) * 100.0
}

impl OverheadBench {
    /// One run of the loop; returns (loop seconds, stalls).
    async fn run_once(
        &self,
        params: &Params,
        mode: Mode,
        url: &str,
        seed: u64,
    ) -> Result<(f64, Vec<f64>), Error> {
        let chunk = ckpt_core::CheckpointerOptions::default().write.chunk_size;
        let cp = match mode {
            Mode::None => None,
            Mode::Lazy => Some(
                ckpt_formats::builder(url)
                    .snapshot(SnapshotMode::Lazy)
                    .build()
                    .await?,
            ),
            _ => Some(ckpt_formats::builder(url).build().await?),
        };
        let mut stalls = Vec::new();
        let mut handles: Vec<SaveHandle> = Vec::new();
        let start = Instant::now();
        for step in 1..=self.steps {
            tokio::time::sleep(self.compute).await; // forward + backward on the device
            if mode == Mode::Lazy {
                if let Some(h) = handles.last() {
                    if !h.snapshot_done() {
                        let t = Instant::now();
                        h.wait_snapshot().await?;
                        *stalls.last_mut().expect("one per save") += t.elapsed().as_secs_f64();
                    }
                }
            }
            params.touch_all(seed * 1000 + step, chunk); // optimizer step
            let Some(cp) = &cp else { continue };
            if step % self.every != 0 {
                continue;
            }
            let t = Instant::now();
            let h = cp.save(step, params.capture()).await?;
            if mode == Mode::Blocking {
                h.wait().await?;
            } else {
                handles.push(h);
            }
            stalls.push(t.elapsed().as_secs_f64());
        }
        let loop_s = start.elapsed().as_secs_f64();
        for h in handles {
            h.wait().await?;
        }
        Ok((loop_s, stalls))
    }

    /// Run every setup on `state`.
    pub async fn run(&self, ctx: &Ctx, state: &State) -> Result<OverheadResults, Error> {
        let params = Params::from_state(state);
        let modes = [Mode::None, Mode::Blocking, Mode::EagerAsync, Mode::Lazy];
        let pb = ctx.bar((modes.len() * ctx.repeats + 2) as u64, "overhead");
        let mut rows: Vec<OverheadRow> = Vec::new();
        for mode in modes {
            pb.set_message(mode.name());
            let (mut loops, mut stalls, mut peak) = (vec![], vec![], 0u64);
            for rep in 0..ctx.repeats {
                let dir = ctx.fresh_dir(&format!("overhead-{rep}"))?;
                let before = rss_bytes();
                let sampler = PeakSampler::start();
                let (l, s) = self
                    .run_once(&params, mode, &file_url(&dir), rep as u64 + 1)
                    .await?;
                peak = peak.max(sampler.finish().saturating_sub(before));
                loops.push(l);
                stalls.extend(s);
                let _ = std::fs::remove_dir_all(&dir);
                pb.inc(1);
            }
            let loop_s = Summary::of(&loops);
            let reference = rows.first().map_or(loop_s.median, |r| r.loop_s.median);
            rows.push(OverheadRow {
                name: mode.name().to_owned(),
                slowdown_pct: slowdown_pct(loop_s.median, reference),
                loop_s,
                stall_s: Summary::of(if stalls.is_empty() { &[0.0] } else { &stalls }),
                peak_extra_bytes: peak,
            });
        }
        let mut python_error = None;
        match &ctx.python {
            None => python_error = Some("no Python interpreter (set CKPT_PYTHON)".to_owned()),
            Some(py) => {
                let dir = ctx.fresh_dir("overhead-python")?;
                let exported = python::export(state, &dir)?;
                for mode in ["torch_save", "dcp_async_save"] {
                    pb.set_message(mode);
                    let args: Vec<String> = vec![
                        "--mode".into(),
                        mode.into(),
                        "--repeats".into(),
                        ctx.repeats.to_string(),
                        "--steps".into(),
                        self.steps.to_string(),
                        "--every".into(),
                        self.every.to_string(),
                        "--compute-ms".into(),
                        (self.compute.as_secs_f64() * 1000.0).to_string(),
                    ];
                    match python::run(py, &exported, "overhead", &args) {
                        Ok(v) => {
                            let (none, loops, stalls) = (
                                python::floats(&v, "none_loop_s"),
                                python::floats(&v, "loop_s"),
                                python::floats(&v, "stalls_s"),
                            );
                            if none.is_empty() || loops.is_empty() || stalls.is_empty() {
                                return Err(format!("overhead baseline {mode}: no timings").into());
                            }
                            let loop_s = Summary::of(&loops);
                            rows.push(OverheadRow {
                                name: mode
                                    .replace("_save", ".save")
                                    .replace("dcp_async.save", "dcp.async_save"),
                                slowdown_pct: slowdown_pct(
                                    loop_s.median,
                                    Summary::of(&none).median,
                                ),
                                loop_s,
                                stall_s: Summary::of(&stalls),
                                peak_extra_bytes: v["peak_extra_bytes"].as_u64().unwrap_or(0),
                            });
                        }
                        Err(e) => {
                            python_error = Some(e);
                            break;
                        }
                    }
                    pb.inc(1);
                }
                let _ = std::fs::remove_dir_all(&dir);
            }
        }
        pb.finish_and_clear();
        Ok(OverheadResults {
            state_bytes: state.nbytes(),
            steps: self.steps,
            every: self.every,
            compute_s: self.compute.as_secs_f64(),
            rows,
            python_error,
        })
    }
}

/// Options of the overhead experiment (on the shared state).
#[derive(clap::Args, Debug, Clone, Default)]
pub struct Overhead {
    /// Overhead: training steps per run [default: 8].
    #[arg(long)]
    pub steps: Option<u64>,
    /// Overhead: checkpoint every this many steps [default: 4].
    #[arg(long)]
    pub every: Option<u64>,
    /// Overhead: emulated compute per step, milliseconds [default: 100, about
    /// an accelerator step of a mid-sized model; --full: 200].
    #[arg(long)]
    pub compute_ms: Option<u64>,
}

impl Overhead {
    fn bench(&self, ctx: &Ctx) -> OverheadBench {
        let compute_ms = self.compute_ms.unwrap_or(if ctx.full { 200 } else { 100 });
        OverheadBench {
            steps: self.steps.unwrap_or(8),
            every: self.every.unwrap_or(4).max(1),
            compute: Duration::from_millis(compute_ms),
        }
    }

    /// Run it on the shared state (kept for the interval experiment).
    pub async fn results(&self, ctx: &Ctx) -> Result<OverheadResults, Error> {
        if let Some(r) = ctx.kept::<OverheadResults>() {
            return Ok(r);
        }
        let shared = ctx.state().await?;
        let r = self.bench(ctx).run(ctx, &shared.0).await?;
        ctx.keep(r.clone());
        Ok(r)
    }
}

#[async_trait::async_trait]
impl Experiment for Overhead {
    fn name(&self) -> &'static str {
        "overhead"
    }

    fn about(&self, ctx: &Ctx) -> String {
        let b = self.bench(ctx);
        format!(
            "{} steps of {} ms, a checkpoint every {}, {} MiB",
            b.steps,
            b.compute.as_millis(),
            b.every,
            ctx.spec.mib
        )
    }

    fn estimate_s(&self, ctx: &Ctx) -> f64 {
        let b = self.bench(ctx);
        let setups = if ctx.python.is_some() { 6.0 } else { 4.0 };
        // Per run: the emulated compute, and about 3 s per GiB saved (62 s for
        // 3 repeats of 256 MiB on a busy 2-core machine).
        let saves = 3.0 * (b.steps / b.every) as f64 * ctx.spec.mib as f64 / 1024.0;
        ctx.repeats as f64 * setups * (b.steps as f64 * b.compute.as_secs_f64() + saves)
    }

    async fn run(&self, ctx: &Ctx) -> Result<Output, Error> {
        let o = self.results(ctx).await?;
        let mut out = Output::of(&o);
        out.tables.push(table(&o));
        out.charts.push(("overhead_stall".into(), chart(&o)));
        if let Some(e) = &o.python_error {
            out.notes.push(format!(
                "Python baselines of the overhead experiment missing: {e}"
            ));
        }
        Ok(out)
    }
}

/// The overhead table.
pub fn table(o: &OverheadResults) -> Table {
    let mut t = Table::new(
        "overhead",
        format!(
            "Overhead: {} steps of {} ms emulated compute, a checkpoint every {} steps, {} MiB",
            o.steps,
            (o.compute_s * 1000.0).round(),
            o.every,
            mib(o.state_bytes as f64)
        ),
        &[
            "setup",
            "loop s",
            "stall/save s",
            "slowdown %",
            "peak extra MiB",
        ],
    );
    for x in &o.rows {
        t.rows.push(vec![
            x.name.clone(),
            secs(&x.loop_s),
            secs(&x.stall_s),
            format!("{:.1}", x.slowdown_pct),
            mib(x.peak_extra_bytes as f64),
        ]);
    }
    t
}

/// Stall per checkpoint, by setup.
pub fn chart(o: &OverheadResults) -> Chart {
    Chart::Bars {
        title: "Training stall per checkpoint".into(),
        unit: "seconds".into(),
        bars: o
            .rows
            .iter()
            .skip(1)
            .map(|x| {
                bar(
                    &x.name,
                    &x.stall_s,
                    usize::from(!x.name.starts_with("ckpt")),
                )
            })
            .collect(),
        reference: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slowdown_by_hand() {
        assert!((slowdown_pct(1.25, 1.0) - 25.0).abs() < 1e-12);
        assert!((slowdown_pct(0.9, 1.0) + 10.0).abs() < 1e-12);
        assert_eq!(slowdown_pct(1.0, 0.0), 0.0);
    }
}
