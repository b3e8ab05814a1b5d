//! fsdp-scale: ckpt's coordination and metadata against DCP's as ranks grow.
//! A deep FSDP2 MLP (hundreds of `fully_shard`ed blocks, a few bytes each) and
//! AdamW under torchrun (gloo on CPU), saved and loaded by ckpt's
//! `Checkpointer` and by `dcp.save`/`dcp.load` in the same run, at each rank
//! count; the times are coordination and metadata, not bytes.
//!
//! The ranks run `evaluator/python/fsdp_scale.py` (embedded); its docstring
//! says what each figure is. Every time is the slowest rank's. The targets
//! compare ckpt with DCP in the same run: its save and load grow no faster
//! with ranks (log-log slopes) and take at most 0.3x DCP's at the largest
//! rank count; they are reported, not asserted.

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use serde_json::Value as Json;

use super::script::{last_json, python_missing, run_bounded};
use super::{Ctx, Error, Experiment, Output};
use crate::python::write_bench_script;
use crate::stats::Summary;

mod render;
mod results;
pub use render::{charts, tables};
pub use results::{log_log_slope, slopes, targets, FsdpScaleResults, FsdpScaleRun, Slope};

/// The rank script, embedded so the binary works from any directory.
pub const SCRIPT: &str = include_str!("../../../python/fsdp_scale.py");

/// Settings of the experiment.
#[derive(Debug, Clone)]
pub struct FsdpScaleBench {
    /// Rank counts (one torchrun job each).
    pub ranks: Vec<usize>,
    /// FSDP2 blocks of the model.
    pub blocks: usize,
    /// Width of each block's Linear.
    pub width: usize,
    /// Repetitions per rank count.
    pub repeats: usize,
    /// Limit for one torchrun job.
    pub timeout: Duration,
}

/// Why this experiment cannot run here, if it cannot: no interpreter, or no
/// FSDP2, DCP or ckpt package in it.
pub fn unavailable(python: Option<&Path>) -> Option<String> {
    python_missing(
        python,
        "torch.distributed.fsdp, torch.distributed.checkpoint, ckpt",
    )
}

/// The summary of a key's values over the repetitions in `v["runs"]`.
fn over_runs(v: &Json, key: &str) -> Result<Summary, Error> {
    let xs: Vec<f64> = v["runs"]
        .as_array()
        .map(|a| a.iter().filter_map(|r| r[key].as_f64()).collect())
        .unwrap_or_default();
    if xs.is_empty() {
        return Err(format!("no {key} in its runs").into());
    }
    Ok(Summary::of(&xs))
}

/// Turn the JSON rank 0 printed into a run.
pub fn parse_run(v: &Json) -> Result<FsdpScaleRun, Error> {
    let (c, d) = (&v["ckpt"], &v["dcp"]);
    let bytes = |x: &Json, k: &str| x[k].as_u64().ok_or_else(|| format!("no {k}"));
    Ok(FsdpScaleRun {
        ranks: v["ranks"].as_u64().ok_or("no ranks")? as usize,
        tensors_per_rank: v["tensors_per_rank"].as_u64().unwrap_or(0),
        setup_s: v["setup_s"].as_f64().unwrap_or(f64::NAN),
        ckpt_open_s: over_runs(c, "open_s")?,
        ckpt_save_s: over_runs(c, "save_s")?,
        ckpt_later_save_s: over_runs(c, "later_save_s")?,
        ckpt_load_s: over_runs(c, "load_s")?,
        dcp_save_s: over_runs(d, "save_s")?,
        dcp_load_s: over_runs(d, "load_s")?,
        manifest_bytes: bytes(c, "manifest_bytes")?,
        manifests_total_bytes: bytes(c, "manifests_total_bytes")?,
        data_metadata_bytes: bytes(c, "data_metadata_bytes").unwrap_or(0),
        dcp_metadata_bytes: bytes(d, "metadata_bytes")?,
    })
}

/// A finished job's JSON line and run, or why there is none.
fn parse_job(ok: bool, stdout: &str, stderr: &str) -> Result<(Json, FsdpScaleRun), Error> {
    let v = last_json(ok, stdout, stderr, "the job")?;
    let run = parse_run(&v)?;
    Ok((v, run))
}

impl FsdpScaleBench {
    /// Run one torchrun job per rank count with `python`.
    pub fn run(&self, ctx: &Ctx, python: &Path) -> Result<FsdpScaleResults, Error> {
        let dir = ctx.fresh_dir("fsdp-scale")?;
        let script = write_bench_script(&dir, "fsdp_scale.py", SCRIPT)?;
        let mut ranks = self.ranks.clone();
        ranks.sort_unstable();
        ranks.dedup();
        let pb = ctx.bar(ranks.len() as u64, "fsdp-scale");
        let (mut runs, mut torch, mut failed) = (Vec::new(), String::new(), None);
        for &n in &ranks {
            pb.set_message(format!("{n} ranks"));
            let work = dir.join(format!("ranks-{n}"));
            let mut cmd = Command::new(python);
            cmd.current_dir(&dir)
                .args([
                    "-m",
                    "torch.distributed.run",
                    "--standalone",
                    "--nproc-per-node",
                ])
                .arg(n.to_string())
                .arg(&script)
                .arg("--dir")
                .arg(&work)
                .args(["--blocks", &self.blocks.to_string()])
                .args(["--width", &self.width.to_string()])
                .args(["--repeats", &self.repeats.max(1).to_string()]);
            let job = run_bounded(cmd, self.timeout, "torchrun");
            let _ = std::fs::remove_dir_all(&work);
            match job.and_then(|(ok, stdout, stderr)| parse_job(ok, &stdout, &stderr)) {
                Ok((v, run)) => {
                    torch = v["torch"].as_str().unwrap_or("").to_owned();
                    runs.push(run);
                }
                // The smaller rank counts' figures are kept; the larger ones are not tried.
                Err(e) if !runs.is_empty() => {
                    failed = Some(format!("fsdp_scale.py on {n} ranks: {e}"));
                    break;
                }
                Err(e) => return Err(format!("fsdp_scale.py on {n} ranks: {e}").into()),
            }
            pb.inc(1);
        }
        pb.finish_and_clear();
        let _ = std::fs::remove_dir_all(&dir);
        let slopes = slopes(&runs);
        Ok(FsdpScaleResults {
            torch,
            blocks: self.blocks,
            width: self.width,
            repeats: self.repeats.max(1),
            targets: targets(&runs, &slopes),
            slopes,
            runs,
            failed,
        })
    }
}

/// Options of the fsdp-scale experiment.
#[derive(clap::Args, Debug, Clone, Default)]
pub struct FsdpScale {
    /// fsdp-scale: rank counts to run under torchrun [default: 4,8; --full: 4,8,16,32; 2 ranks' times are too small for a slope].
    #[arg(long, value_delimiter = ',')]
    pub fsdp_ranks: Option<Vec<usize>>,
    /// fsdp-scale: fully_shard'ed blocks of the model, 4 tensors each per rank
    /// with AdamW [default: 100; --full: 400].
    #[arg(long)]
    pub fsdp_blocks: Option<usize>,
    /// fsdp-scale: width of each block's Linear, also its rows that FSDP2
    /// shards [default: 16, or the largest rank count if larger, so that every
    /// rank holds a shard of every weight].
    #[arg(long)]
    pub fsdp_width: Option<usize>,
    /// fsdp-scale: repetitions per rank count, each into fresh directories [default: 1].
    #[arg(long)]
    pub fsdp_repeats: Option<usize>,
    /// fsdp-scale: seconds one torchrun job may take; past it, or when it
    /// fails, the smaller rank counts are reported and the larger not run [default: 900].
    #[arg(long)]
    pub fsdp_timeout_s: Option<u64>,
}

impl FsdpScale {
    fn bench(&self, ctx: &Ctx) -> FsdpScaleBench {
        let full = ctx.full;
        let ranks = self.fsdp_ranks.clone().unwrap_or_else(|| {
            if full {
                vec![4, 8, 16, 32]
            } else {
                vec![4, 8]
            }
        });
        // FSDP2 shards each weight's rows: with fewer rows than ranks, the
        // last ranks hold empty shards and the larger rank counts measure
        // fewer shards than they have ranks.
        let most = ranks.iter().copied().max().unwrap_or(1);
        FsdpScaleBench {
            ranks,
            blocks: self
                .fsdp_blocks
                .unwrap_or(if full { 400 } else { 100 })
                .max(1),
            width: self.fsdp_width.unwrap_or(most.max(16)).max(1),
            repeats: self.fsdp_repeats.unwrap_or(1).max(1),
            timeout: Duration::from_secs(self.fsdp_timeout_s.unwrap_or(900).max(1)),
        }
    }
}

#[async_trait::async_trait]
impl Experiment for FsdpScale {
    fn name(&self) -> &'static str {
        "fsdp-scale"
    }

    fn about(&self, ctx: &Ctx) -> String {
        let b = self.bench(ctx);
        format!(
            "FSDP2 MLP of {} blocks of width {} plus AdamW on {:?} ranks: ckpt beside DCP",
            b.blocks, b.width, b.ranks
        )
    }

    fn estimate_s(&self, ctx: &Ctx) -> f64 {
        // Per job: start-up, then work that grows with ranks times blocks
        // (82 s for 100 blocks on 4 and 8 ranks on a busy 2-core machine).
        let b = self.bench(ctx);
        b.ranks
            .iter()
            .map(|&n| 10.0 + 0.05 * (n * b.blocks * b.repeats) as f64)
            .sum()
    }

    fn unavailable(&self, ctx: &Ctx) -> Option<String> {
        unavailable(ctx.python.as_deref())
    }

    async fn run(&self, ctx: &Ctx) -> Result<Output, Error> {
        let py = ctx.python.as_deref().ok_or("no Python interpreter")?;
        let r = self.bench(ctx).run(ctx, py)?;
        let mut out = Output::of(&r);
        out.tables = tables(&r);
        out.charts = charts(&r);
        out.targets = r.targets.clone();
        out.notes.extend(r.failed.clone());
        Ok(out)
    }
}

#[cfg(test)]
mod tests;
