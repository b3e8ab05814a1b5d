//! Scale under `mpirun`: the same data-parallel state checkpointed by 1, 2, 4
//! and 8 processes, with and without deduplication of replicated tensors.
//!
//! Every rank holds the whole state (data parallelism). With dedup, each tensor is
//! written once in total, spread over the ranks; without, every rank writes a full
//! copy. Per rank count: the stall of `save` and the time until the checkpoint is
//! committed (the slowest rank's, per save), the bytes written, the aggregate
//! throughput (state bytes / time to commit), and, as MLPerf Storage reports it,
//! the minimum over ranks of each rank's own throughput. Checkpoints are fsynced.
//!
//! The machine's limits apply: ranks beyond the core count share cores
//! (`--oversubscribe`), and all ranks share one disk, so the figures show the
//! protocol's overhead and the effect of dedup, not a cluster's scaling.

use std::path::{Path, PathBuf};

use serde::Serialize;

use crate::experiments::{Ctx, Error};
use crate::plot::Chart;
use crate::stats::Summary;
use crate::table::{mib, secs, Table};

/// Settings of the scale experiment.
#[derive(Debug, Clone)]
pub struct ScaleBench {
    /// Rank counts to run.
    pub ranks: Vec<usize>,
    /// State size, MiB (every rank holds all of it).
    pub mib: usize,
    /// Tensors of the state.
    pub tensors: usize,
}

/// One rank count, with or without dedup.
#[derive(Debug, Clone, Serialize)]
pub struct ScaleRow {
    /// Number of ranks.
    pub ranks: usize,
    /// Replicated tensors written once (true) or by every rank (false).
    pub dedup: bool,
    /// Stall of `save`, the slowest rank's per save, s.
    pub stall_s: Summary,
    /// Time until committed, the slowest rank's per save, s.
    pub commit_s: Summary,
    /// Bytes written by all ranks for one checkpoint.
    pub written_bytes: u64,
    /// State bytes / median time to commit, GB/s.
    pub aggregate_gbps: f64,
    /// Minimum over ranks of (bytes the rank wrote / its time to commit), GB/s.
    pub min_rank_gbps: f64,
}

/// Results of the scale experiment.
#[derive(Debug, Clone, Serialize)]
pub struct ScaleResults {
    /// State bytes.
    pub state_bytes: u64,
    /// Cores of this machine (ranks beyond it share cores).
    pub cores: usize,
    /// The rows.
    pub rows: Vec<ScaleRow>,
}

/// The rank program: `$CKPT_SCALE_RANK`, or `scale_rank` built next to the running
/// program (or one folder up, for test binaries) with the `mpi` feature.
pub fn rank_binary() -> Result<PathBuf, Error> {
    if let Some(p) = std::env::var_os("CKPT_SCALE_RANK") {
        return Ok(PathBuf::from(p));
    }
    let exe = std::env::current_exe()?;
    let dir = exe.parent().ok_or("no folder for the running program")?;
    [dir.join("scale_rank"), dir.join("../scale_rank")]
        .into_iter()
        .find(|p| p.exists())
        .ok_or_else(|| {
            format!(
                "scale_rank not found next to {}: build ckpt-eval with `--features mpi` (scripts/eval.sh does)",
                exe.display()
            )
            .into()
        })
}

fn mpirun(np: usize, bin: &Path, args: &[String]) -> Result<Vec<serde_json::Value>, Error> {
    let out = ckpt_core::testing::mpirun(np)
        .arg(bin)
        .args(args)
        .output()
        .map_err(|e| format!("mpirun: {e} (is OpenMPI installed?)"))?;
    if !out.status.success() {
        return Err(format!(
            "mpirun -np {np} failed: {}",
            String::from_utf8_lossy(&out.stderr)
        )
        .into());
    }
    let rows: Vec<serde_json::Value> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect();
    if rows.len() != np {
        return Err(format!("expected {np} rank reports, got {}", rows.len()).into());
    }
    Ok(rows)
}

fn floats(v: &serde_json::Value, key: &str) -> Vec<f64> {
    v[key]
        .as_array()
        .map(|a| a.iter().filter_map(|x| x.as_f64()).collect())
        .unwrap_or_default()
}

/// Summarise the rank reports of one run.
pub fn summarise(
    ranks: usize,
    dedup: bool,
    reports: &[serde_json::Value],
) -> Result<ScaleRow, Error> {
    /// One rank's stalls, commit times and bytes written, per save.
    struct Rank {
        stall: Vec<f64>,
        commit: Vec<f64>,
        written: Vec<f64>,
    }
    let per_rank: Vec<Rank> = reports
        .iter()
        .map(|r| Rank {
            stall: floats(r, "stall_s"),
            commit: floats(r, "commit_s"),
            written: floats(r, "written_bytes"),
        })
        .collect();
    let saves = per_rank.first().map_or(0, |p| p.stall.len());
    if saves == 0
        || per_rank
            .iter()
            .any(|p| p.stall.len() != saves || p.commit.len() != saves || p.written.len() != saves)
    {
        return Err("rank reports of different lengths".into());
    }
    let slowest = |f: fn(&Rank) -> &Vec<f64>| -> Vec<f64> {
        (0..saves)
            .map(|k| per_rank.iter().map(|p| f(p)[k]).fold(0.0, f64::max))
            .collect()
    };
    let stall_s = Summary::of(&slowest(|p| &p.stall));
    let commit_s = Summary::of(&slowest(|p| &p.commit));
    let state_bytes = reports[0]["state_bytes"].as_f64().unwrap_or(0.0);
    let written: f64 = per_rank
        .iter()
        .map(|p| Summary::of(&p.written).median)
        .sum();
    let min_rank_gbps = per_rank
        .iter()
        .map(|p| Summary::of(&p.written).median / Summary::of(&p.commit).median / 1e9)
        .fold(f64::INFINITY, f64::min);
    Ok(ScaleRow {
        ranks,
        dedup,
        aggregate_gbps: state_bytes / commit_s.median / 1e9,
        stall_s,
        commit_s,
        written_bytes: written as u64,
        min_rank_gbps,
    })
}

impl ScaleBench {
    /// Run every rank count, with and without dedup.
    pub fn run(&self, ctx: &Ctx) -> Result<ScaleResults, Error> {
        let bin = rank_binary()?;
        let mut rows = Vec::new();
        let mut state_bytes = 0;
        let pb = ctx.bar((self.ranks.len() * 2) as u64, "scale");
        for &np in &self.ranks {
            for dedup in [true, false] {
                let root = ctx.scratch.join(format!("scale-{np}-{dedup}"));
                let _ = std::fs::remove_dir_all(&root);
                let mut args = vec![
                    "--root".to_string(),
                    root.display().to_string(),
                    "--mib".into(),
                    self.mib.to_string(),
                    "--tensors".into(),
                    self.tensors.to_string(),
                    "--repeats".into(),
                    ctx.repeats.to_string(),
                ];
                if !dedup {
                    args.push("--no-dedup".into());
                }
                let reports = mpirun(np, &bin, &args)?;
                state_bytes = reports[0]["state_bytes"].as_u64().unwrap_or(0);
                rows.push(summarise(np, dedup, &reports)?);
                let _ = std::fs::remove_dir_all(&root);
                pb.inc(1);
            }
        }
        pb.finish_and_clear();
        let cores = std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1);
        Ok(ScaleResults {
            state_bytes,
            cores,
            rows,
        })
    }
}

/// The scale table.
pub fn table(sc: &ScaleResults) -> Table {
    let mut t = Table::new(
        "scale",
        format!(
            "Scale: ckpt saving {} MiB of data-parallel state held by every rank, fsynced; slowest rank per save, median [min-max] of {} saves; this machine has {} cores and one disk (ranks beyond that share them)",
            mib(sc.state_bytes as f64),
            sc.rows.first().map_or(0, |x| x.commit_s.n),
            sc.cores
        ),
        &["ranks", "dedup", "stall s", "commit s", "written MiB", "aggregate GB/s", "min rank GB/s"],
    );
    for x in &sc.rows {
        t.rows.push(vec![
            x.ranks.to_string(),
            if x.dedup { "yes" } else { "no" }.into(),
            secs(&x.stall_s),
            secs(&x.commit_s),
            mib(x.written_bytes as f64),
            format!("{:.2}", x.aggregate_gbps),
            format!("{:.3}", x.min_rank_gbps),
        ]);
    }
    t
}

/// Aggregate throughput by ranks, with and without dedup.
pub fn chart(sc: &ScaleResults) -> Chart {
    let series = |dedup: bool| -> Vec<(f64, f64)> {
        sc.rows
            .iter()
            .filter(|x| x.dedup == dedup)
            .map(|x| (x.ranks as f64, x.aggregate_gbps))
            .collect()
    };
    Chart::Lines {
        title: "Checkpoint throughput by ranks (state / time to commit)".into(),
        x_label: "ranks".into(),
        y_label: "GB/s".into(),
        log_x: true,
        series: vec![
            ("dedup".into(), series(true)),
            ("no dedup".into(), series(false)),
        ],
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn summary_takes_the_slowest_rank_and_the_weakest_throughput() {
        let reports = vec![
            serde_json::json!({"state_bytes": 1e9, "stall_s": [0.1, 0.3], "commit_s": [1.0, 2.0], "written_bytes": [5e8, 5e8]}),
            serde_json::json!({"state_bytes": 1e9, "stall_s": [0.2, 0.1], "commit_s": [1.5, 1.0], "written_bytes": [5e8, 5e8]}),
        ];
        let row = summarise(2, true, &reports).unwrap();
        // Slowest per save: stall [0.2, 0.3], commit [1.5, 2.0].
        assert_eq!(row.stall_s.median, 0.25);
        assert_eq!(row.commit_s.median, 1.75);
        assert_eq!(row.written_bytes, 1_000_000_000);
        // 1e9 bytes / 1.75 s.
        assert!((row.aggregate_gbps - 1.0 / 1.75).abs() < 1e-12);
        // Rank 0: 5e8 / 1.5 s (median of 1.0 and 2.0); rank 1: 5e8 / 1.25 s.
        assert!((row.min_rank_gbps - 0.5 / 1.5).abs() < 1e-12);
        let bad = vec![serde_json::json!({"stall_s": [], "commit_s": [], "written_bytes": []})];
        assert!(summarise(1, true, &bad).is_err());
    }
}
