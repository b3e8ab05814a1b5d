//! Scale, two ways.
//!
//! - Under `mpirun` ([`mpi`]): the same data-parallel state checkpointed by a
//!   few processes on this machine's disk, with and without dedup.
//! - Simulated ([`sim`], `--simulate`): thousands of ranks as tasks of this
//!   process, each running the real engine (save, commit, load, GC) on one
//!   in-memory store, with every collective byte and store request counted
//!   per rank: what each rank and rank 0 cost as the job grows.
//!
//! A rank count whose collective bytes, projected from the two largest
//! smaller counts' growth, exceed the budget is skipped and says so. The
//! root of a job larger than this process can save (16,384 ranks of 1,600
//! tensors) is built by the commit's own code from one rank's tensors
//! ([`ckpt_core::testing::root_of`]).

pub mod mpi;
mod render;
pub mod sim;
pub mod state;
pub mod store;
pub mod stored;
#[cfg(test)]
mod tests;

use serde::Serialize;

use crate::experiments::{Ctx, Error, Experiment, Output};
use mpi::{rank_binary, ScaleBench, ScaleResults};
use sim::{RankRun, SimShape};
use stored::StoredFigures;

/// The smallest job measured before any larger one, so that every larger
/// count has a projection.
const PROBE_RANKS: usize = 64;

/// A rank count of the simulation: what it measured, or why it was skipped.
#[derive(Debug, Clone, Serialize)]
pub struct SimRow {
    /// Ranks.
    pub ranks: usize,
    /// What it measured.
    pub run: Option<RankRun>,
    /// Collective bytes every rank together would receive in one save, as
    /// projected from the largest smaller count.
    pub projected_received_all: Option<u64>,
    /// Why it was skipped.
    pub skipped: Option<String>,
}

/// Settings of the simulation.
#[derive(Debug, Clone, Serialize)]
pub struct SimBench {
    /// Rank counts.
    pub ranks: Vec<usize>,
    /// Every rank's state and retention.
    pub shape: SimShape,
    /// A rank count whose projected bytes received in all exceed this is skipped.
    pub budget_bytes: u64,
    /// Checkpoints kept, for the retention and restart figures.
    pub stored: Vec<usize>,
}

/// Ranks and tensors per rank of the job whose root is built, not saved.
pub const ROOT_RANKS: usize = 16384;
/// Sharded tensors per rank of it (an FSDP2 job's parameters and Adam's
/// moments), besides [`ROOT_REPLICATED`] replicated ones (Adam's steps).
pub const ROOT_SHARDED: usize = 1200;
/// Replicated tensors per rank of it.
pub const ROOT_REPLICATED: usize = 400;
/// Bytes a record takes in a fragment, for the built root's fragment sizes.
const RECORD_BYTES: u64 = 256;

/// The root of a job too large to save here, built by the commit's code.
#[derive(Debug, Clone, Serialize)]
pub struct BuiltRoot {
    /// Ranks.
    pub ranks: usize,
    /// Tensors per rank (sharded, replicated, and one of its own).
    pub tensors: usize,
    /// The encoded root's bytes.
    pub bytes: u64,
}

impl BuiltRoot {
    /// Build it.
    pub fn make() -> Result<BuiltRoot, Error> {
        let shape = state::Shape {
            sharded: ROOT_SHARDED,
            replicated: ROOT_REPLICATED,
        };
        let st = state::of_rank(shape, 0, ROOT_RANKS, 1)?;
        let bytes = ckpt_core::testing::root_of(
            &st.tensors,
            ROOT_RANKS,
            RECORD_BYTES * ROOT_SHARDED as u64,
        )?;
        Ok(BuiltRoot {
            ranks: ROOT_RANKS,
            tensors: st.tensors.len(),
            bytes: bytes.len() as u64,
        })
    }
}

/// Results of the simulation.
#[derive(Debug, Clone, Serialize)]
pub struct SimResults {
    /// Its settings.
    pub bench: SimBench,
    /// One per rank count, smallest first.
    pub rows: Vec<SimRow>,
    /// The root of a job of [`ROOT_RANKS`] ranks of 1,600 tensors.
    pub built_root: Option<BuiltRoot>,
    /// The retention and restart figures by checkpoints stored.
    pub stored: Vec<StoredFigures>,
}

impl SimBench {
    /// The rank counts in the order they run: ascending, with the probe
    /// first when every count is larger.
    fn counts(&self) -> Vec<usize> {
        let mut v: Vec<usize> = self.ranks.iter().copied().filter(|&n| n > 0).collect();
        v.sort_unstable();
        v.dedup();
        if v.first().is_some_and(|&n| n > PROBE_RANKS) {
            v.insert(0, PROBE_RANKS);
        }
        v
    }

    /// Run every rank count (or skip it) and the retention figures.
    pub async fn run(&self, ctx: &Ctx) -> Result<SimResults, Error> {
        let counts = self.counts();
        let pb = ctx.bar((counts.len() + self.stored.len()) as u64, "scale sim");
        let mut rows: Vec<SimRow> = Vec::new();
        for n in counts {
            pb.set_message(format!("{n} ranks"));
            let projected = project(&rows, n);
            let mut row = SimRow {
                ranks: n,
                run: None,
                projected_received_all: projected,
                skipped: None,
            };
            match projected {
                Some(p) if p > self.budget_bytes => {
                    row.skipped = Some(format!(
                        "skipped: projected {:.1} GiB received in all (budget {:.1} GiB)",
                        gib(p),
                        gib(self.budget_bytes)
                    ));
                }
                _ => row.run = Some(sim::run_ranks(n, self.shape).await?),
            }
            rows.push(row);
            pb.inc(1);
        }
        let mut stored = Vec::new();
        for &k in &self.stored {
            pb.set_message(format!("{k} stored"));
            stored.push(stored::measure(k, self.shape.state).await?);
            pb.inc(1);
        }
        pb.finish_and_clear();
        Ok(SimResults {
            bench: self.clone(),
            rows,
            built_root: Some(BuiltRoot::make()?),
            stored,
        })
    }

    /// Seconds on a 2-core machine: about linear in the ranks (each rank's
    /// share of a save is flat; rank 0's gathers grow with the job).
    fn estimate_s(&self) -> f64 {
        let per_rank = (self.shape.state.sharded + 3) as f64 / 7.0;
        let mut s = 1.0 + self.stored.iter().map(|&k| 0.01 * k as f64).sum::<f64>();
        for n in self.counts() {
            s += per_rank * SECS_PER_1024_RANKS * n as f64 / 1024.0;
        }
        s
    }
}

/// Seconds the simulation takes per 1,024 ranks (7 tensors each) on a busy
/// 2-core machine: three saves and two loads.
const SECS_PER_1024_RANKS: f64 = 6.0;

/// Collective bytes every rank together would receive in one save at `n`
/// ranks: the largest measured count's, grown as the two largest grew
/// (linearly when only one ran).
fn project(rows: &[SimRow], n: usize) -> Option<u64> {
    let mut ran = rows.iter().rev().filter_map(|r| r.run.as_ref());
    let last = ran.next()?;
    let slope = ran
        .next()
        .filter(|prev| prev.ranks < last.ranks && prev.received_all() > 0)
        .map_or(1.0, |prev| {
            (last.received_all() as f64 / prev.received_all() as f64).ln()
                / (last.ranks as f64 / prev.ranks as f64).ln()
        })
        .max(1.0);
    let f = n as f64 / last.ranks as f64;
    Some((last.received_all() as f64 * f.powf(slope)) as u64)
}

fn gib(b: u64) -> f64 {
    b as f64 / (1u64 << 30) as f64
}

/// Options of the scale experiment.
#[derive(clap::Args, Debug, Clone, Default)]
pub struct Scale {
    /// Scale: rank counts to run under mpirun [default: 1,2,4; --full: 1,2,4,8];
    /// with --simulate, the simulated counts (as --sim-ranks).
    #[arg(long, value_delimiter = ',')]
    pub ranks: Option<Vec<usize>>,
    /// Scale: state size in MiB (every rank holds all of it) [default: 64; --full: 128].
    #[arg(long)]
    pub scale_mib: Option<usize>,
    /// Scale: only the simulated mode: ranks as tasks of this process, the
    /// real engine on a memory:// store, bytes and store requests counted.
    #[arg(long)]
    pub simulate: bool,
    /// Scale: simulated rank counts [default: 64,512 (about a minute on 2
    /// cores); with --simulate or --full: 64,1024,16384].
    #[arg(long, value_delimiter = ',')]
    pub sim_ranks: Option<Vec<usize>>,
    /// Scale: sharded tensors per simulated rank (besides 2 replicated and 1
    /// of its own) [default: 4].
    #[arg(long)]
    pub sim_tensors: Option<usize>,
    /// Scale: skip a simulated rank count whose projected collective bytes
    /// (all ranks together, one save) exceed this many GiB [default: 4].
    #[arg(long)]
    pub sim_budget_gib: Option<f64>,
    /// Scale: checkpoints kept for the retention and restart figures [default: 2,8,32].
    #[arg(long, value_delimiter = ',')]
    pub sim_stored: Option<Vec<usize>>,
}

impl Scale {
    fn bench(&self, ctx: &Ctx) -> ScaleBench {
        let full = ctx.full;
        ScaleBench {
            ranks: self.ranks.clone().unwrap_or_else(|| {
                if full {
                    vec![1, 2, 4, 8]
                } else {
                    vec![1, 2, 4]
                }
            }),
            mib: self.scale_mib.unwrap_or(if full { 128 } else { 64 }),
            tensors: 32,
        }
    }

    /// The simulation's settings.
    pub fn sim(&self, ctx: &Ctx) -> SimBench {
        let given = self
            .sim_ranks
            .clone()
            .or_else(|| self.ranks.clone().filter(|_| self.simulate));
        SimBench {
            ranks: given.unwrap_or_else(|| {
                if self.simulate || ctx.full {
                    vec![64, 1024, 16384]
                } else {
                    vec![64, 512]
                }
            }),
            shape: SimShape {
                state: state::Shape {
                    sharded: self.sim_tensors.unwrap_or(4),
                    replicated: 2,
                },
                keep_last: 2,
            },
            budget_bytes: (self.sim_budget_gib.unwrap_or(4.0) * (1u64 << 30) as f64) as u64,
            stored: self.sim_stored.clone().unwrap_or_else(|| vec![2, 8, 32]),
        }
    }

    /// Whether the mpirun mode runs: not with --simulate, and only where the
    /// rank program was built (why not, otherwise).
    fn mpirun(&self) -> Result<bool, String> {
        if self.simulate {
            return Ok(false);
        }
        rank_binary().map(|_| true).map_err(|e| e.to_string())
    }
}

/// What `results.json` holds for the scale experiment.
#[derive(Debug, Serialize)]
struct Both<'a> {
    mpirun: Option<&'a ScaleResults>,
    simulated: &'a SimResults,
}

#[async_trait::async_trait]
impl Experiment for Scale {
    fn name(&self) -> &'static str {
        "scale"
    }

    fn about(&self, ctx: &Ctx) -> String {
        let s = self.sim(ctx);
        match self.mpirun() {
            Ok(true) => {
                let b = self.bench(ctx);
                format!(
                    "{} MiB on {:?} ranks under mpirun; simulated {:?} ranks",
                    b.mib, b.ranks, s.ranks
                )
            }
            _ => format!("simulated {:?} ranks", s.ranks),
        }
    }

    fn estimate_s(&self, ctx: &Ctx) -> f64 {
        let mut s = self.sim(ctx).estimate_s();
        if let Ok(true) = self.mpirun() {
            // Per job: mpirun's start-up, then saves of every rank's MiB on one
            // disk (8 s for 1, 2 and 4 ranks of 64 MiB on a busy 2-core machine).
            let b = self.bench(ctx);
            let mib: usize = b.ranks.iter().sum::<usize>() * b.mib;
            s += b.ranks.len() as f64 + 0.01 * mib as f64;
        }
        s
    }

    async fn run(&self, ctx: &Ctx) -> Result<Output, Error> {
        let mut tables = Vec::new();
        let mut charts = Vec::new();
        let mut notes = Vec::new();
        let mpirun = match self.mpirun() {
            Ok(true) => {
                let sc = self.bench(ctx).run(ctx)?;
                tables.push(mpi::table(&sc));
                charts.push(("scale_throughput".to_string(), mpi::chart(&sc)));
                Some(sc)
            }
            Ok(false) => None,
            Err(why) => {
                notes.push(format!("scale under mpirun not run: {why}"));
                None
            }
        };
        let sim = self.sim(ctx).run(ctx).await?;
        let mut out = Output::of(&Both {
            mpirun: mpirun.as_ref(),
            simulated: &sim,
        });
        if sim.rows.iter().any(|r| r.skipped.is_some()) {
            notes.push(
                "scale (simulated): a rank count is skipped when the collective bytes every rank together would receive in one save, projected from the two largest smaller counts' growth, exceed --sim-budget-gib".into(),
            );
        }
        tables.extend(render::tables(&sim));
        charts.push(("sim_scale_bytes".into(), render::chart(&sim)));
        out.tables = tables;
        out.charts = charts;
        out.notes = notes;
        out.targets = render::targets(&sim);
        Ok(out)
    }
}
