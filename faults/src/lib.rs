//! `ckpt-faults`: fault campaigns, a test harness of ckpt. A seeded plan of failures over real
//! training jobs: SIGKILLs at random instants and inside each phase of a save,
//! bit flips, truncations and deletions of stored objects between runs, storage
//! errors and timeouts, a full disk, a rank killed under mpirun. After each failure
//! the job restarts from `load_latest`; an oracle that checks the stored
//! checkpoints on disk says where it must resume and what it must skip; at the end
//! the final state is compared bitwise with a failure-free run of the same seed.
//!
//! - [`plan`]: the seeded generator and the kinds of failure;
//! - [`inject`]: damage to objects, a tmpfs filled with ballast, SIGKILL by pid;
//! - [`oracle`]: the committed checkpoints and which are intact, checked on disk;
//! - [`victim`]: one supervised start of the tch job (`fault_victim`);
//! - [`event`]: what the victim reports to the runner, a typed line each;
//! - [`run`]: a tch run through its failures; [`mpi`]: the MPI kinds;
//! - [`baseline`]: the same state restarted through libtorch's serializer, for
//!   the restart figures' comparison;
//! - [`record`]: what is recorded of each start and run;
//! - [`report`]: the summary and its text.
//!
//! The victim is built with `cargo build -p ckpt-faults --features victim` (tch on
//! the venv's libtorch and ckpt's failpoints: `source scripts/env.sh` first).
#![warn(missing_docs)]

pub mod baseline;
pub mod error;
pub mod event;
pub mod inject;
pub mod mpi;
pub mod oracle;
pub mod plan;
pub mod record;
pub mod report;
pub mod run;
pub mod victim;
pub mod zombie;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Instant;

use clap::Parser;

use plan::{Kind, KindStream, Rng};
use record::RunRecord;
use report::CampaignReport;

/// What a campaign does.
#[derive(Debug, Clone)]
pub struct CampaignConfig {
    /// Failures to inject.
    pub count: u64,
    /// Seed of the plan.
    pub seed: u64,
    /// Kinds to draw from.
    pub kinds: Vec<Kind>,
    /// Training steps of the tch job.
    pub steps: u64,
    /// Its checkpoint interval.
    pub every: u64,
    /// Checkpoints it keeps.
    pub keep: usize,
    /// `cpu` or `cuda`.
    pub device: String,
    /// Most failures in one run before it is taken to its end.
    pub per_run: u64,
    /// The victim's program: the `fault_victim` binary, or an interpreter
    /// whose script (`victim_args`) takes the same arguments.
    pub victim: PathBuf,
    /// Arguments before the victim's own (a script's path).
    pub victim_args: Vec<String>,
    /// The MPI jobs.
    pub mpi: mpi::MpiBins,
    /// Where runs keep their checkpoints.
    pub work: PathBuf,
    /// A line per run on stderr.
    pub progress: bool,
    /// Fewest restores of the torch baseline: one after each tch run, topped up
    /// to this many at the end (0: no baseline).
    pub torch_restores: usize,
}

impl CampaignConfig {
    /// Defaults for `count` failures with seed `seed` and the victim at `victim`.
    pub fn new(count: u64, seed: u64, victim: PathBuf, work: PathBuf) -> Self {
        CampaignConfig {
            count,
            seed,
            kinds: Kind::ALL.to_vec(),
            steps: 40,
            every: 4,
            keep: 3,
            device: "cpu".into(),
            per_run: 8,
            victim,
            victim_args: Vec::new(),
            mpi: mpi::MpiBins::default(),
            work,
            progress: false,
            torch_restores: 3,
        }
    }
}

/// Whether a tmpfs can be mounted under `work`.
fn probe_mount(work: &Path) -> Result<(), String> {
    inject::Tmpfs::mount(&work.join("mount-probe"), 1)
        .map(drop)
        .map_err(|e| e.to_string())
}

/// Run a campaign.
pub fn campaign(cfg: &CampaignConfig) -> Result<CampaignReport, error::Error> {
    let t0 = Instant::now();
    std::fs::create_dir_all(&cfg.work)?;
    let work = std::fs::canonicalize(&cfg.work)?;
    let mut not_run = Vec::new();
    let mut kinds = cfg.kinds.clone();
    for (k, bin, name) in [
        (Kind::MpiRank, &cfg.mpi.ckpt, "mpi_ckpt"),
        (Kind::MpiTrain, &cfg.mpi.train, "mpi_train"),
    ] {
        if kinds.contains(&k) {
            if let Some(why) = mpi::unavailable(bin, name) {
                kinds.retain(|x| *x != k);
                not_run.push((k.name().to_owned(), why));
            }
        }
    }
    let can_mount = if kinds.contains(&Kind::DiskFull) {
        probe_mount(&work)
    } else {
        Err("not needed".into())
    };
    let mut ctx = run::TchCtx {
        job: victim::Job {
            bin: cfg.victim.clone(),
            bin_args: cfg.victim_args.clone(),
            steps: cfg.steps,
            every: cfg.every.max(1),
            keep: cfg.keep,
            seed: 0,
            device: cfg.device.clone(),
        },
        work: work.clone(),
        can_mount,
        references: HashMap::new(),
    };
    // The same state restarted through libtorch's serializer, on the tch job's
    // model and device, restored after each tch run.
    let mut torch = (cfg.torch_restores > 0).then(|| {
        let job = victim::Job {
            seed: 1000,
            ..ctx.job.clone()
        };
        baseline::Runner::new(job, work.join("torch-baseline"))
    });
    let mut mpi_refs = HashMap::new();
    let mut rng = Rng::new(cfg.seed);
    let mut stream = KindStream::new(&kinds);
    let mut runs: Vec<RunRecord> = Vec::new();
    let mut injected = 0u64;
    let mut idle = 0;
    while injected < cfg.count && idle < 20 {
        let Some(first) = stream.next(&mut rng) else {
            break;
        };
        let index = runs.len();
        let mut sub = rng.fork();
        let rec = if first.is_mpi() {
            match first {
                Kind::MpiRank => mpi::rank_kill(
                    cfg.mpi.ckpt.as_deref().expect("checked"),
                    &work,
                    index,
                    &mut sub,
                ),
                _ => mpi::train_kill(
                    cfg.mpi.train.as_deref().expect("checked"),
                    &work,
                    index,
                    &mut sub,
                    &mut mpi_refs,
                ),
            }
        } else {
            let budget = rng.range(3, cfg.per_run.max(3)).min(cfg.count - injected);
            let mut run_kinds = vec![first];
            while (run_kinds.len() as u64) < budget.max(1) {
                match stream.next(&mut rng) {
                    Some(k) if k.is_mpi() => {
                        stream.push_back(k);
                        break;
                    }
                    Some(k) => run_kinds.push(k),
                    None => break,
                }
            }
            let rec = run::tch_run(&mut ctx, index, &mut sub, &run_kinds);
            if let Some(t) = &mut torch {
                t.restore();
            }
            rec
        };
        let n = rec.failures.len() as u64;
        injected += n;
        idle = if n == 0 { idle + 1 } else { 0 };
        if cfg.progress {
            eprintln!(
                "run {index:>4} {:<9} {:>2} failures {:>6.1} s  {}  [{injected}/{}]{}",
                rec.job,
                n,
                rec.seconds,
                if rec.passed() { "pass" } else { "FAIL" },
                cfg.count,
                rec.problems
                    .first()
                    .map(|p| format!("  {p}"))
                    .unwrap_or_default()
            );
        }
        runs.push(rec);
    }
    let full_disk = match &ctx.can_mount {
        Ok(()) => "a 32 MiB tmpfs filled with ballast (ENOSPC)".to_owned(),
        Err(why) => format!("FaultStore failing every write ({why})"),
    };
    let torch = match (torch, runs.iter().any(|r| r.job == "tch")) {
        (None, _) => None,
        (Some(_), false) => {
            not_run.push(("torch baseline".into(), "no tch run".into()));
            None
        }
        (Some(t), true) => match t.finish(cfg.torch_restores) {
            Ok(b) => Some(b),
            Err(why) => {
                not_run.push(("torch baseline".into(), why.to_string()));
                None
            }
        },
    };
    let mut summary = report::summarize(&runs, t0.elapsed().as_secs_f64(), &full_disk);
    summary.torch_baseline = torch.map(|b| baseline::compare(&runs, b));
    summary.not_run = not_run;
    if injected < cfg.count {
        summary.problems.push(format!(
            "only {injected} of {} failures could be injected",
            cfg.count
        ));
    }
    let config = serde_json::json!({
        "count": cfg.count, "seed": cfg.seed, "steps": cfg.steps, "every": cfg.every,
        "keep": cfg.keep, "device": cfg.device, "torch_restores": cfg.torch_restores,
        "kinds": kinds.iter().map(|k| k.name()).collect::<Vec<_>>(),
    });
    Ok(CampaignReport {
        config,
        summary,
        runs,
    })
}

/// Find a sibling binary of the running one (same target directory, any profile).
pub fn find_binary(name: &str) -> Option<PathBuf> {
    let exe = std::env::current_exe().ok()?;
    let dir = exe.parent()?;
    let mut dirs = vec![dir.to_path_buf()];
    if dir.ends_with("deps") {
        dirs.extend(dir.parent().map(Path::to_path_buf));
    }
    let base = dirs.last()?.clone();
    if let Some(target) = base.parent() {
        dirs.push(target.join("release"));
        dirs.push(target.join("debug"));
    }
    dirs.into_iter().map(|d| d.join(name)).find(|p| p.is_file())
}

/// Command line of `ckpt-faults`.
#[derive(Parser, Debug)]
#[command(
    name = "ckpt-faults",
    bin_name = "ckpt-faults",
    about = "Fault campaigns: train, inject failures, restart, and prove nothing was lost"
)]
pub struct FaultsCli {
    /// Failures to inject.
    #[arg(long, default_value_t = 100)]
    pub count: u64,
    /// Seed of the plan.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Kinds, comma separated (kill, crash, parked, corrupt, store-faults, disk-full,
    /// zombie, mpi-rank, mpi-train).
    #[arg(long, value_delimiter = ',')]
    pub kinds: Option<Vec<String>>,
    /// Training steps of the tch job.
    #[arg(long, default_value_t = 40)]
    pub steps: u64,
    /// Checkpoint every this many steps.
    #[arg(long, default_value_t = 4)]
    pub every: u64,
    /// Checkpoints kept.
    #[arg(long, default_value_t = 3)]
    pub keep: usize,
    /// Most failures per tch run.
    #[arg(long, default_value_t = 8)]
    pub per_run: u64,
    /// Device of the tch job (cpu, cuda).
    #[arg(long, default_value = "cpu")]
    pub device: String,
    /// The victim binary (default: fault_victim next to this one).
    #[arg(long)]
    pub victim: Option<PathBuf>,
    /// mpi_ckpt (default: next to this one, any profile).
    #[arg(long)]
    pub mpi_ckpt: Option<PathBuf>,
    /// mpi_train (default: next to this one, any profile).
    #[arg(long)]
    pub mpi_train: Option<PathBuf>,
    /// Where runs keep their checkpoints.
    #[arg(long, default_value = "runs/scratch/faults")]
    pub scratch: PathBuf,
    /// Where the report goes (a new directory inside).
    #[arg(long, default_value = "runs")]
    pub out: PathBuf,
    /// No progress lines.
    #[arg(long)]
    pub quiet: bool,
    /// Fewest restores of the torch baseline (the same state through libtorch's
    /// serializer), timed after each tch run and topped up at the end; 0: none.
    #[arg(long, default_value_t = 3)]
    pub torch_restores: usize,
}

/// `ckpt-faults ARGS...` (`args` starts with `faults`).
pub fn main(args: impl IntoIterator<Item = String>) -> ExitCode {
    let cli = FaultsCli::parse_from(args);
    let kinds = match &cli.kinds {
        None => Kind::ALL.to_vec(),
        Some(ks) => {
            let mut v = Vec::new();
            for k in ks {
                match Kind::parse(k) {
                    Some(k) => v.push(k),
                    None => {
                        eprintln!("unknown kind {k}");
                        return ExitCode::FAILURE;
                    }
                }
            }
            v
        }
    };
    let Some(victim) = cli.victim.clone().or_else(|| find_binary("fault_victim")) else {
        eprintln!(
            "fault_victim not found: build it with `source scripts/env.sh && cargo build --release -p ckpt-faults --features victim` (or pass --victim)"
        );
        return ExitCode::FAILURE;
    };
    let mut cfg = CampaignConfig::new(cli.count, cli.seed, victim, cli.scratch.clone());
    cfg.kinds = kinds;
    cfg.steps = cli.steps;
    cfg.every = cli.every;
    cfg.keep = cli.keep;
    cfg.per_run = cli.per_run;
    cfg.device = cli.device.clone();
    cfg.progress = !cli.quiet;
    cfg.torch_restores = cli.torch_restores;
    cfg.mpi = mpi::MpiBins {
        ckpt: cli.mpi_ckpt.clone().or_else(|| find_binary("mpi_ckpt")),
        train: cli.mpi_train.clone().or_else(|| find_binary("mpi_train")),
    };
    let report = match campaign(&cfg) {
        Ok(r) => r,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::FAILURE;
        }
    };
    let text = report::to_text(&report);
    println!("{text}");
    let stamp = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default()
        .as_secs();
    let dir = cli.out.join(format!("faults-{stamp}"));
    let written = std::fs::create_dir_all(&dir)
        .and_then(|_| {
            std::fs::write(
                dir.join("faults.json"),
                serde_json::to_vec_pretty(&report).unwrap_or_default(),
            )
        })
        .and_then(|_| std::fs::write(dir.join("faults.md"), format!("```text\n{text}```\n")));
    match written {
        Ok(()) => println!("report: {}", dir.join("faults.md").display()),
        Err(e) => eprintln!("writing the report: {e}"),
    }
    if report.passed() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}
