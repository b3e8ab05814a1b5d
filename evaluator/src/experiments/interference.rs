//! Interference, both ways:
//!
//! - the same checkpoint (eager save until committed) with no noise and while a
//!   noise generator loads memory bandwidth, disk, CPU or the loopback network
//!   (one at a time, at the chosen intensity): stall and time to commit, as a
//!   ratio to the quiet machine;
//! - how much checkpointing in the background slows a compute-bound loop (a CPU
//!   kernel on the training thread, checkpoint every `every` steps, eager async).

use std::time::{Duration, Instant};

use ckpt_core::State;
use serde::Serialize;

use super::overhead::slowdown_pct;
use super::{file_url, Ctx, Error, Experiment, Output};
use crate::noise::{Noise, NoiseKind};
use crate::plot::{bar, Chart};
use crate::stats::{ratio, Summary};
use crate::table::{mib, secs, Table};
use crate::workload::Params;

/// Settings of the interference experiment.
#[derive(Debug, Clone)]
pub struct InterferenceBench {
    /// Threads per noise generator.
    pub intensity: usize,
    /// Steps of the compute-bound loop.
    pub steps: u64,
    /// Checkpoint every this many steps in the compute-bound loop.
    pub every: u64,
    /// CPU work per step of the compute-bound loop (iterations of the kernel).
    pub kernel_iters: u64,
}

/// Checkpoints under one kind of noise.
#[derive(Debug, Clone, Serialize)]
pub struct NoiseRow {
    /// `none` or the noise's name.
    pub noise: String,
    /// Stall per save, seconds.
    pub stall_s: Summary,
    /// Time to commit per save, seconds.
    pub commit_s: Summary,
    /// Time to commit over the quiet machine's.
    pub commit_vs_quiet: f64,
    /// The noise's own work rate while it ran (bytes/s; operations/s for CPU).
    pub noise_rate: f64,
}

/// Results of the interference experiment.
#[derive(Debug, Clone, Serialize)]
pub struct InterferenceResults {
    /// Raw bytes of the state.
    pub state_bytes: u64,
    /// Threads per noise generator.
    pub intensity: usize,
    /// One row per noise; the first is the quiet machine.
    pub rows: Vec<NoiseRow>,
    /// Compute-bound loop without checkpoints, seconds.
    pub compute_loop_s: Summary,
    /// The same loop checkpointing every `every` steps, seconds.
    pub compute_loop_ckpt_s: Summary,
    /// Slowdown of the compute-bound loop, percent.
    pub compute_slowdown_pct: f64,
}

/// A CPU-bound kernel standing in for compute on the training thread.
pub fn kernel(iters: u64, seed: f64) -> f64 {
    let mut x = seed;
    for i in 0..iters {
        x = (x * 1.000_000_3 + i as f64 * 1e-9).sqrt() + 0.25;
    }
    x
}

impl InterferenceBench {
    async fn saves(
        &self,
        ctx: &Ctx,
        params: &Params,
        tag: &str,
    ) -> Result<(Vec<f64>, Vec<f64>), Error> {
        let chunk = ckpt_core::CheckpointerOptions::default().write.chunk_size;
        let dir = ctx.fresh_dir(&format!("interference-{tag}"))?;
        let cp = ckpt_formats::builder(file_url(&dir)).build().await?;
        // One save first so every timed save has a warm staging pool.
        params.touch_all(1, chunk);
        cp.save(1, params.capture()).await?.wait().await?;
        let (mut stall, mut commit) = (vec![], vec![]);
        for rep in 0..ctx.repeats as u64 {
            params.touch_all(rep + 2, chunk);
            let t = Instant::now();
            let h = cp.save(rep + 2, params.capture()).await?;
            stall.push(t.elapsed().as_secs_f64());
            h.wait().await?;
            commit.push(t.elapsed().as_secs_f64());
        }
        drop(cp);
        let _ = std::fs::remove_dir_all(&dir);
        Ok((stall, commit))
    }

    async fn compute_loop(
        &self,
        ctx: &Ctx,
        params: &Params,
        checkpoint: bool,
    ) -> Result<f64, Error> {
        let chunk = ckpt_core::CheckpointerOptions::default().write.chunk_size;
        let dir = ctx.fresh_dir("interference-compute")?;
        let cp = ckpt_formats::builder(file_url(&dir)).build().await?;
        let mut handles = Vec::new();
        let mut acc = 0.0;
        let start = Instant::now();
        for step in 1..=self.steps {
            acc += kernel(self.kernel_iters, step as f64);
            params.touch_all(step, chunk);
            if checkpoint && step % self.every == 0 {
                handles.push(cp.save(step, params.capture()).await?);
            }
        }
        let secs = start.elapsed().as_secs_f64();
        std::hint::black_box(acc);
        for h in handles {
            h.wait().await?;
        }
        drop(cp);
        let _ = std::fs::remove_dir_all(&dir);
        Ok(secs)
    }

    /// Run on `state`.
    pub async fn run(&self, ctx: &Ctx, state: &State) -> Result<InterferenceResults, Error> {
        let params = Params::from_state(state);
        let pb = ctx.bar(
            (NoiseKind::ALL.len() + 1 + 2 * ctx.repeats) as u64,
            "interference",
        );
        let mut rows: Vec<NoiseRow> = Vec::new();
        let kinds: Vec<Option<NoiseKind>> = std::iter::once(None)
            .chain(NoiseKind::ALL.map(Some))
            .collect();
        for kind in kinds {
            let name = kind.map_or("none", NoiseKind::name);
            pb.set_message(name);
            let noise = match kind {
                Some(k) => Some(Noise::start(
                    k,
                    self.intensity,
                    &ctx.scratch.join("noise"),
                    Duration::from_secs(120),
                )?),
                None => None,
            };
            if noise.is_some() {
                tokio::time::sleep(Duration::from_millis(200)).await; // let it ramp up
            }
            let (stall, commit) = self
                .saves(ctx, &params, name.split(' ').next().unwrap_or("x"))
                .await?;
            let noise_rate = noise.map_or(0.0, Noise::finish);
            let commit_s = Summary::of(&commit);
            let quiet = rows
                .first()
                .map_or(commit_s.clone(), |r| r.commit_s.clone());
            rows.push(NoiseRow {
                noise: name.to_owned(),
                stall_s: Summary::of(&stall),
                commit_vs_quiet: ratio(&commit_s, &quiet),
                commit_s,
                noise_rate,
            });
            pb.inc(1);
        }
        let _ = std::fs::remove_dir_all(ctx.scratch.join("noise"));
        pb.set_message("compute-bound loop");
        let (mut plain, mut with) = (vec![], vec![]);
        for _ in 0..ctx.repeats {
            plain.push(self.compute_loop(ctx, &params, false).await?);
            pb.inc(1);
            with.push(self.compute_loop(ctx, &params, true).await?);
            pb.inc(1);
        }
        pb.finish_and_clear();
        let (compute_loop_s, compute_loop_ckpt_s) = (Summary::of(&plain), Summary::of(&with));
        Ok(InterferenceResults {
            state_bytes: state.nbytes(),
            intensity: self.intensity,
            rows,
            compute_slowdown_pct: slowdown_pct(compute_loop_ckpt_s.median, compute_loop_s.median),
            compute_loop_s,
            compute_loop_ckpt_s,
        })
    }
}

/// Options of the interference experiment.
#[derive(clap::Args, Debug, Clone, Default)]
pub struct Interference {
    /// Interference: threads per noise generator [default: 1].
    #[arg(long)]
    pub intensity: Option<usize>,
    /// Interference: state size in MiB (shaped like the shared state) [default: 64].
    #[arg(long)]
    pub interference_mib: Option<usize>,
}

impl Interference {
    fn mib(&self) -> usize {
        self.interference_mib.unwrap_or(64)
    }
}

#[async_trait::async_trait]
impl Experiment for Interference {
    fn name(&self) -> &'static str {
        "interference"
    }

    fn about(&self, _ctx: &Ctx) -> String {
        format!(
            "{} MiB saved under memory, disk, CPU and loopback noise at {} thread(s)",
            self.mib(),
            self.intensity.unwrap_or(1)
        )
    }

    fn estimate_s(&self, ctx: &Ctx) -> f64 {
        // Measured on a busy 2-core machine: 9 s for 3 repeats of 64 MiB.
        5.0 + ctx.repeats as f64 * (1.0 + 10.0 * self.mib() as f64 / 1024.0)
    }

    async fn run(&self, ctx: &Ctx) -> Result<Output, Error> {
        let small = ctx.spec.build(self.mib(), 2)?;
        let i = InterferenceBench {
            intensity: self.intensity.unwrap_or(1),
            steps: 12,
            every: 4,
            kernel_iters: 12_000_000,
        }
        .run(ctx, &small)
        .await?;
        let mut out = Output::of(&i);
        out.tables.push(table(&i));
        out.charts.push(("interference".into(), chart(&i)));
        Ok(out)
    }
}

/// The interference table.
pub fn table(i: &InterferenceResults) -> Table {
    let mut t = Table::new(
        "interference",
        format!(
            "Interference: a ckpt eager save until committed, {} MiB, noise at {} thread(s)",
            mib(i.state_bytes as f64),
            i.intensity
        ),
        &["noise", "stall s", "commit s", "commit/quiet", "noise rate"],
    );
    for x in &i.rows {
        t.rows.push(vec![
            x.noise.clone(),
            secs(&x.stall_s),
            secs(&x.commit_s),
            format!("{:.2}", x.commit_vs_quiet),
            format!("{:.3e}", x.noise_rate),
        ]);
    }
    t.rows.push(vec![
        "compute-bound loop slowed by checkpointing".into(),
        String::new(),
        format!(
            "{:.3} vs {:.3}",
            i.compute_loop_ckpt_s.median, i.compute_loop_s.median
        ),
        format!("{:+.1}%", i.compute_slowdown_pct),
        String::new(),
    ]);
    t
}

/// Time to commit under each noise.
pub fn chart(i: &InterferenceResults) -> Chart {
    Chart::Bars {
        title: "Save until committed under noise".into(),
        unit: "seconds".into(),
        bars: i
            .rows
            .iter()
            .enumerate()
            .map(|(k, x)| bar(&x.noise, &x.commit_s, usize::from(k > 0)))
            .collect(),
        reference: None,
    }
}
