//! Sharded: the same FSDP2 model and AdamW state on 2 and 4 ranks (torchrun, gloo
//! on CPU), checkpointed by ckpt (eager, lazy, lazy through an `AppState`), `torch.distributed.checkpoint`
//! (`dcp.save`, `dcp.async_save` with its stager, `dcp.load`) and
//! `torch-checkpointing`'s `CheckpointManager`, side by side, each as a ratio to
//! the machine's floors measured by the same ranks in the same run.
//!
//! The ranks run `evaluator/python/sharded_bench.py` (embedded); its docstring
//! says what each figure is and what each method does to be durable. Every figure
//! is the slowest (largest) rank's. Targets of the sharded-state issue compare
//! ckpt with the others as ratios in the same run; they are reported, not asserted.

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use serde_json::Value as Json;

use super::script::{free_port, last_json, python_missing, run_bounded};
use super::{ratio, Ctx, Error, Experiment, Output, Target};
use crate::python;
use crate::python::write_bench_script;
use crate::stats::Summary;

mod render;
mod results;
pub use render::{charts, tables};
pub use results::{ShardedFloors, ShardedResults, ShardedRow, ShardedRun};

/// The rank script, embedded so the binary works from any directory.
pub const SCRIPT: &str = include_str!("../../../python/sharded_bench.py");

/// Settings of the sharded experiment.
#[derive(Debug, Clone)]
pub struct ShardedBench {
    /// Rank counts (one torchrun job each).
    pub ranks: Vec<usize>,
    /// MiB of f32 parameters (AdamW adds twice that).
    pub mib: f64,
    /// Timed saves and loads per method (after a cold and a warm save, sampled for memory, not timed).
    pub repeats: usize,
    /// Limit for one torchrun job.
    pub timeout: Duration,
}

/// Why this experiment cannot run here, if it cannot: no interpreter, or no
/// `torch.distributed` or ckpt package in it (a table of the peers without
/// ckpt would compare nothing).
pub fn unavailable(python: Option<&Path>) -> Option<String> {
    python_missing(
        python,
        "torch.distributed.fsdp, torch.distributed.checkpoint, ckpt",
    )
}

/// Turn the JSON rank 0 printed into a run.
pub fn parse_run(v: &Json) -> Result<ShardedRun, Error> {
    let ranks = v["ranks"].as_u64().ok_or("no ranks")? as usize;
    let local = v["local_bytes"].as_u64().ok_or("no local_bytes")?;
    let f = &v["floors"];
    let floors = ShardedFloors {
        write_fsync_s: f["write_fsync_s"].as_f64().ok_or("no write floor")?,
        read_cold_s: f["read_cold_s"].as_f64().ok_or("no read floor")?,
        memcpy_s: f["memcpy_s"].as_f64().ok_or("no memcpy floor")?,
        cache_drop: f["cache_drop"].as_str().unwrap_or("none").to_owned(),
    };
    let mut rows = Vec::new();
    for m in v["methods"].as_array().ok_or("no methods")? {
        let name = m["name"].as_str().unwrap_or("?").to_owned();
        let skipped = m["skipped"].as_str().map(str::to_owned);
        let (stall_s, snapshot_s, durable_s, load_s) = (
            python::summary(m, "stall_s"),
            python::summary(m, "snapshot_s"),
            python::summary(m, "durable_s"),
            python::summary(m, "load_s"),
        );
        if skipped.is_none() && (stall_s.is_none() || durable_s.is_none() || load_s.is_none()) {
            return Err(format!("{name} on {ranks} ranks: no timings").into());
        }
        let written = python::summary(m, "written_bytes").map_or(0.0, |s| s.median);
        let peak = python::summary(m, "peak_extra_bytes").map_or(0.0, |s| s.max);
        rows.push(ShardedRow {
            ranks,
            name,
            skipped,
            stall_vs_memcpy: ratio(stall_s.as_ref(), floors.memcpy_s),
            durable_vs_write: ratio(durable_s.as_ref(), floors.write_fsync_s),
            load_vs_read: ratio(load_s.as_ref(), floors.read_cold_s),
            written_vs_local: written / local as f64,
            peak_vs_local: peak / local as f64,
            stall_s,
            snapshot_s,
            durable_s,
            load_s,
            written_bytes: written as u64,
            peak_extra_bytes: peak as u64,
        });
    }
    Ok(ShardedRun {
        ranks,
        hidden: v["hidden"].as_u64().unwrap_or(0),
        param_bytes: v["param_bytes"].as_u64().unwrap_or(0),
        local_bytes: local,
        floors,
        rows,
    })
}

/// The targets for each ckpt mode and rank count, as ratios of medians.
pub fn targets(runs: &[ShardedRun]) -> Vec<Target> {
    let mut out = Vec::new();
    let med = |r: Option<&ShardedRow>, f: fn(&ShardedRow) -> Option<&Summary>| {
        r.and_then(f).map(|s| s.median)
    };
    for run in runs {
        let row = |name: &str| {
            run.rows
                .iter()
                .find(|x| x.name == name && x.skipped.is_none())
        };
        for mode in ["ckpt eager", "ckpt lazy"] {
            let Some(me) = row(mode) else { continue };
            let mut push = |what: String, ratio: Option<f64>, bound: f64| {
                if let Some(ratio) = ratio {
                    out.push(Target {
                        what: format!("{} ranks, {mode}: {what}", run.ranks),
                        ratio,
                        bound,
                        met: ratio <= bound,
                    });
                }
            };
            let stall = med(Some(me), |x| x.stall_s.as_ref());
            let durable = med(Some(me), |x| x.durable_s.as_ref());
            let load = med(Some(me), |x| x.load_s.as_ref());
            let div = |a: Option<f64>, b: Option<f64>| a.zip(b).map(|(a, b)| a / b);
            for peer in ["dcp.async_save", "torch-checkpointing"] {
                push(
                    format!("stall / {peer}'s"),
                    div(stall, med(row(peer), |x| x.stall_s.as_ref())),
                    0.5,
                );
            }
            push(
                "time until durable / dcp.save's".into(),
                div(durable, med(row("dcp.save"), |x| x.durable_s.as_ref())),
                0.8,
            );
            push(
                "load / dcp.load's".into(),
                div(load, med(row("dcp.save"), |x| x.load_s.as_ref())),
                0.8,
            );
            push(
                "peak extra host memory / local state".into(),
                Some(me.peak_vs_local),
                1.1,
            );
        }
        // DCP's own calls with ckpt's storage, against DCP's FileSystemWriter
        // and reader: what a DCP user gets without changing anything else.
        let durable = |name: &str| med(row(name), |x| x.durable_s.as_ref());
        let load = |name: &str| med(row(name), |x| x.load_s.as_ref());
        for (ours, what, ratio) in [
            (
                "dcp.save -> ckpt",
                "time until durable / with DCP's FileSystemWriter",
                durable("dcp.save -> ckpt").zip(durable("dcp.save")),
            ),
            (
                "dcp.save -> ckpt",
                "dcp.load / with DCP's FileSystemReader",
                load("dcp.save -> ckpt").zip(load("dcp.save")),
            ),
            (
                "dcp.async_save -> ckpt",
                "time until durable / with DCP's FileSystemWriter",
                durable("dcp.async_save -> ckpt").zip(durable("dcp.async_save")),
            ),
        ] {
            if let Some((a, b)) = ratio {
                out.push(Target {
                    what: format!("{} ranks, {ours}: {what}", run.ranks),
                    ratio: a / b,
                    bound: 1.0,
                    met: a / b <= 1.0,
                });
            }
        }
    }
    out
}

impl ShardedBench {
    /// Run one torchrun job per rank count with `python`.
    pub fn run(&self, ctx: &Ctx, python: &Path) -> Result<ShardedResults, Error> {
        let dir = ctx.fresh_dir("sharded")?;
        let script = write_bench_script(&dir, "sharded_bench.py", SCRIPT)?;
        let pb = ctx.bar(self.ranks.len() as u64, "sharded");
        let mut runs = Vec::new();
        let mut torch = String::new();
        for &n in &self.ranks {
            pb.set_message(format!("{n} ranks"));
            let work = dir.join(format!("ranks-{n}"));
            let mut cmd = Command::new(python);
            cmd.current_dir(&dir)
                .args(["-m", "torch.distributed.run", "--nproc_per_node"])
                .arg(n.to_string())
                .args(["--master_addr", "127.0.0.1", "--master_port"])
                .arg(free_port()?.to_string())
                .arg(&script)
                .arg("--dir")
                .arg(&work)
                .arg("--mib")
                .arg(self.mib.to_string())
                .arg("--repeats")
                .arg(self.repeats.max(1).to_string());
            let (ok, stdout, stderr) = run_bounded(cmd, self.timeout, "torchrun")?;
            let _ = std::fs::remove_dir_all(&work);
            let v = last_json(
                ok,
                &stdout,
                &stderr,
                &format!("sharded_bench.py on {n} ranks"),
            )?;
            torch = v["torch"].as_str().unwrap_or("").to_owned();
            runs.push(parse_run(&v)?);
            pb.inc(1);
        }
        pb.finish_and_clear();
        let _ = std::fs::remove_dir_all(&dir);
        Ok(ShardedResults {
            torch,
            repeats: self.repeats.max(1),
            targets: targets(&runs),
            runs,
        })
    }
}

/// Options of the sharded experiment.
#[derive(clap::Args, Debug, Clone, Default)]
pub struct Sharded {
    /// Sharded: rank counts to run under torchrun [default: 2; --full: 2,4].
    #[arg(long, value_delimiter = ',')]
    pub sharded_ranks: Option<Vec<usize>>,
    /// Sharded: MiB of f32 parameters of the FSDP2 model (AdamW adds twice that)
    /// [default: 32; --full: 256, far above the engine's fixed costs per rank].
    #[arg(long)]
    pub sharded_mib: Option<f64>,
    /// Sharded: timed saves and loads per method, after a cold and a warm save
    /// (sampled for memory, not timed) [default: 2; --full: 3, so that one slow
    /// load does not decide the median].
    #[arg(long)]
    pub sharded_repeats: Option<usize>,
}

impl Sharded {
    fn bench(&self, ctx: &Ctx) -> ShardedBench {
        let full = ctx.full;
        ShardedBench {
            ranks: self.sharded_ranks.clone().unwrap_or_else(|| {
                if full {
                    vec![2, 4]
                } else {
                    vec![2]
                }
            }),
            mib: self.sharded_mib.unwrap_or(if full { 256.0 } else { 32.0 }),
            repeats: self
                .sharded_repeats
                .unwrap_or(if full { 3 } else { 2 })
                .max(1),
            timeout: Duration::from_secs(600),
        }
    }
}

#[async_trait::async_trait]
impl Experiment for Sharded {
    fn name(&self) -> &'static str {
        "sharded"
    }

    fn about(&self, ctx: &Ctx) -> String {
        let b = self.bench(ctx);
        format!(
            "FSDP2 model of {} MiB of parameters plus AdamW on {:?} ranks",
            b.mib, b.ranks
        )
    }

    fn estimate_s(&self, ctx: &Ctx) -> f64 {
        // Per rank count: start-up, then 8 methods of (2 + repeats) saves and
        // loads (55 s for 2 ranks of 64 MiB of parameters on a busy 2-core machine).
        let b = self.bench(ctx);
        let per_save = 0.026 * b.mib;
        b.ranks.len() as f64 * (15.0 + 8.0 * (2 + b.repeats) as f64 * per_save)
    }

    fn unavailable(&self, ctx: &Ctx) -> Option<String> {
        unavailable(ctx.python.as_deref())
    }

    async fn run(&self, ctx: &Ctx) -> Result<Output, Error> {
        let py = ctx.python.as_deref().ok_or("no Python interpreter")?;
        let sh = self.bench(ctx).run(ctx, py)?;
        let mut out = Output::of(&sh);
        out.tables = tables(&sh);
        out.charts = charts(&sh);
        out.targets = sh.targets.clone();
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_a_run_and_computes_the_targets() {
        let m = |name: &str, stall: f64, durable: f64, load: f64, peak: f64| {
            serde_json::json!({"name": name, "stall_s": [stall], "snapshot_s": [stall],
                "durable_s": [durable], "load_s": [load], "written_bytes": [100.0],
                "peak_extra_bytes": [peak]})
        };
        let v = serde_json::json!({
            "ranks": 2, "hidden": 9, "param_bytes": 10, "local_bytes": 100, "torch": "x",
            "floors": {"write_fsync_s": 1.0, "read_cold_s": 0.5, "memcpy_s": 0.1, "cache_drop": "fadvise"},
            "methods": [
                m("ckpt eager", 0.1, 1.0, 0.5, 105.0),
                m("dcp.save", 2.0, 2.0, 1.0, 10.0),
                m("dcp.async_save", 0.1, 3.0, 1.0, 200.0),
                m("dcp.save -> ckpt", 1.5, 1.5, 1.2, 10.0),
                {"name": "torch-checkpointing", "skipped": "ModuleNotFoundError: x"},
            ]
        });
        let run = parse_run(&v).unwrap();
        assert_eq!(run.rows.len(), 5);
        assert!((run.rows[0].durable_vs_write - 1.0).abs() < 1e-12);
        assert!((run.rows[0].load_vs_read - 1.0).abs() < 1e-12);
        assert!((run.rows[0].peak_vs_local - 1.05).abs() < 1e-12);
        let t = targets(&[run]);
        // Skipped peers give no target: stall vs dcp.async_save, durable, load,
        // memory; then DCP into ckpt's storage: durable and load (no async row).
        assert_eq!(t.len(), 6, "{t:?}");
        assert!(!t[0].met && (t[0].ratio - 1.0).abs() < 1e-12);
        assert!(t[1].met && (t[1].ratio - 0.5).abs() < 1e-12);
        assert!(t[2].met && t[3].met);
        assert!(t[4].met && (t[4].ratio - 0.75).abs() < 1e-12, "{:?}", t[4]);
        assert!(!t[5].met && (t[5].ratio - 1.2).abs() < 1e-12, "{:?}", t[5]);
        assert!(
            t[5].what.contains("dcp.save -> ckpt: dcp.load /"),
            "{}",
            t[5].what
        );
    }
}
