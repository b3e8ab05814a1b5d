//! Memory tier: what a restart after a failure costs by the source it
//! restores from, ckpt's memory tier (`ckpt.MemoryCheckpointer`: each rank's
//! own copy in its node's `/dev/shm`, or its replica on the peer node after a
//! node is lost, or, for a job of one rank fewer, the saved ranks' memory
//! checkpoints merged) beside ckpt on local disk and on S3, and `torch.load`.
//!
//! It runs `evaluator/python/memtier_bench.py` in place with the venv's
//! Python: a data-parallel job of two ranks (one per simulated node) saves
//! once to every source, then is started afresh from each, interleaved, the
//! failure to the first training step timed and every restored rank checked
//! bitwise (`memtier_restart.py`); and, in one process, the restore by a
//! fresh checkpointer from memory, local disk cold and `torch.load` cold.
//! Figures are ratios to ckpt on local disk cold in the same run. S3 is a
//! source when the evaluator is given an S3 URL (`--s3-url`, as for the `s3`
//! experiment). Then a 2-rank training loop of emulated compute saves to the
//! memory tier with and without replication to the peer node, alternating
//! (`memtier_bench.py --loop`): the slowdown replication costs. With
//! `--memtier-episodes` (or `--full`) it also runs the
//! memory tier's fault campaign (`memtier_campaign.py`: node failures and
//! rank kills of a DDP job, every restart checked bitwise).

pub mod render;
pub mod results;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use super::script::{python_missing, run_bounded, tail};
use super::{Ctx, Error, Experiment, Output};
pub use render::render;
use results::{BenchResults, CampaignResults, LoopResults, MemtierResults};

/// Options of the memory-tier experiment.
#[derive(clap::Args, Debug, Clone, Default)]
pub struct Memtier {
    /// Memory tier: MiB of state per rank of the restarted job [default: 64; --full: 1024].
    #[arg(long)]
    pub memtier_mib: Option<usize>,
    /// Memory tier: restarts per source [default: 2; --full: 5].
    #[arg(long)]
    pub memtier_repeats: Option<usize>,
    /// Memory tier: episodes of its fault campaign (node failures and rank
    /// kills of a 4-rank job, about 25 s each on 2 cores) [default: 0; --full: 6].
    #[arg(long)]
    pub memtier_episodes: Option<usize>,
    /// Memory tier: rounds of the training loop with and without replication
    /// (about 9 s per round at the default compute) [default: 1; --full: 5; 0: not run].
    #[arg(long)]
    pub memtier_loop_rounds: Option<usize>,
}

/// The directory of the scripts: `CKPT_EVAL_MEMTIER_DIR`, else
/// `evaluator/python/` of the source tree this binary was built from.
pub fn script_dir() -> PathBuf {
    crate::python::source_path("CKPT_EVAL_MEMTIER_DIR", "python")
}

impl Memtier {
    fn mib(&self, ctx: &Ctx) -> usize {
        self.memtier_mib
            .unwrap_or(if ctx.full { 1024 } else { 64 })
            .max(16)
    }

    fn repeats(&self, ctx: &Ctx) -> usize {
        self.memtier_repeats
            .unwrap_or(if ctx.full { 5 } else { 2 })
            .max(1)
    }

    fn episodes(&self, ctx: &Ctx) -> usize {
        self.memtier_episodes
            .unwrap_or(if ctx.full { 6 } else { 0 })
    }

    fn loop_rounds(&self, ctx: &Ctx) -> usize {
        self.memtier_loop_rounds
            .unwrap_or(if ctx.full { 5 } else { 1 })
    }

    /// The loop: two loops of 40 steps per round, and the job's start.
    fn loop_estimate_s(&self, ctx: &Ctx) -> f64 {
        match self.loop_rounds(ctx) {
            0 => 0.0,
            n => 6.0 + n as f64 * 80.0 * f64::from(Self::loop_compute_ms(ctx)) / 1000.0,
        }
    }

    /// Emulated compute per step of the loop, ms: a GPU step's order of size.
    fn loop_compute_ms(ctx: &Ctx) -> u32 {
        if ctx.full {
            200
        } else {
            100
        }
    }
}

/// Run `script` (in the scripts' directory) with `args`; its JSON file, parsed.
fn run_script<T: serde::de::DeserializeOwned>(
    py: &Path,
    script: &str,
    args: &[String],
    json: &Path,
    limit: Duration,
) -> Result<T, Error> {
    let dir = script_dir();
    let mut cmd = Command::new(py);
    cmd.current_dir(&dir)
        .arg(dir.join(script))
        .args(args)
        .arg("--json")
        .arg(json);
    let (_, stdout, stderr) = run_bounded(cmd, limit, script)?;
    // Written at the end of a run, also of a campaign that exits 1 because an
    // episode resumed torn (the report shows it): absent, the script failed.
    match std::fs::read(json) {
        Ok(bytes) => Ok(serde_json::from_slice(&bytes)?),
        Err(_) => Err(format!(
            "{script} failed:\n{}",
            tail(&format!("{stdout}\n{stderr}"), 12)
        )
        .into()),
    }
}

#[async_trait::async_trait]
impl Experiment for Memtier {
    fn name(&self) -> &'static str {
        "memtier"
    }

    fn about(&self, ctx: &Ctx) -> String {
        let (episodes, rounds) = (self.episodes(ctx), self.loop_rounds(ctx));
        format!(
            "restarts of a 2-rank job with {} MiB per rank from memory, a peer's replica, memory by one rank fewer, local disk{} and torch.load, {} each{}{}",
            self.mib(ctx),
            if ctx.s3_url.is_some() { ", S3" } else { "" },
            self.repeats(ctx),
            if rounds > 0 {
                format!("; {rounds} rounds of a training loop with and without replication")
            } else {
                String::new()
            },
            if episodes > 0 {
                format!("; a campaign of {episodes} episodes")
            } else {
                String::new()
            }
        )
    }

    fn estimate_s(&self, ctx: &Ctx) -> f64 {
        // A job start is a few seconds (two processes importing torch on 2
        // cores), six sources; a campaign episode two 4-rank starts.
        let sources = if ctx.s3_url.is_some() { 6.0 } else { 5.0 };
        10.0 + 3.0 * sources * self.repeats(ctx) as f64
            + self.mib(ctx) as f64 / 100.0 * self.repeats(ctx) as f64
            + 25.0 * self.episodes(ctx) as f64
            + self.loop_estimate_s(ctx)
    }

    fn unavailable(&self, ctx: &Ctx) -> Option<String> {
        let dir = script_dir();
        if !dir.join("memtier_bench.py").exists() {
            return Some(format!("its script is absent from {}", dir.display()));
        }
        python_missing(ctx.python.as_deref(), "torch.distributed, ckpt.memory")
    }

    async fn run(&self, ctx: &Ctx) -> Result<Output, Error> {
        let py = ctx.python.clone().ok_or("no Python interpreter")?;
        let work = ctx.fresh_dir("memtier")?;
        let mut args = vec![
            "--dir".to_owned(),
            work.join("work").display().to_string(),
            "--gib".to_owned(),
            format!("{}", self.mib(ctx) as f64 / 1024.0),
            "--repeats".to_owned(),
            self.repeats(ctx).to_string(),
            "--ranks".to_owned(),
            "2".to_owned(),
        ];
        if let Some(url) = &ctx.s3_url {
            args.extend(["--s3-url".to_owned(), url.clone()]);
        }
        let (episodes, json) = (self.episodes(ctx), work.join("bench.json"));
        let campaign_json = work.join("campaign.json");
        let campaign_dir = work.join("campaign");
        let (rounds, loop_json) = (self.loop_rounds(ctx), work.join("loop.json"));
        let loop_args = [
            "--loop".to_owned(),
            "--dir".to_owned(),
            work.join("loop").display().to_string(),
            "--ranks".to_owned(),
            "2".to_owned(),
            "--rounds".to_owned(),
            rounds.to_string(),
            "--compute-ms".to_owned(),
            Self::loop_compute_ms(ctx).to_string(),
        ];
        let (bench, campaign, replication_loop) = tokio::task::spawn_blocking(move || {
            let bench: BenchResults = run_script(
                &py,
                "memtier_bench.py",
                &args,
                &json,
                Duration::from_secs(900),
            )?;
            let campaign: Option<CampaignResults> = if episodes > 0 {
                Some(run_script(
                    &py,
                    "memtier_campaign.py",
                    &[
                        "--dir".to_owned(),
                        campaign_dir.display().to_string(),
                        "--episodes".to_owned(),
                        episodes.to_string(),
                    ],
                    &campaign_json,
                    Duration::from_secs(120 + 90 * episodes as u64),
                )?)
            } else {
                None
            };
            let replication_loop: Option<LoopResults> = if rounds > 0 {
                Some(run_script(
                    &py,
                    "memtier_bench.py",
                    &loop_args,
                    &loop_json,
                    Duration::from_secs(120 + 60 * rounds as u64),
                )?)
            } else {
                None
            };
            Ok::<_, Error>((bench, campaign, replication_loop))
        })
        .await??;
        let _ = std::fs::remove_dir_all(&work);
        Ok(render(&MemtierResults {
            bench,
            campaign,
            replication_loop,
            s3_not_run: ctx.s3_url.is_none().then(|| {
                "no S3 URL given (--s3-url or CKPT_EVAL_S3_URL, and the AWS_* variables)".into()
            }),
        }))
    }
}
