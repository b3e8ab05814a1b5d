//! Every experiment, run at a tiny size, produces well-formed results, and the
//! report of a whole suite run holds every table, CSV and plot. The Python
//! baselines run where the project's interpreter is found (`$CKPT_PYTHON` or the
//! repo's `.venv`), and their rows are then required.

use std::time::Duration;

use ckpt_eval::experiments::determinism::DeterminismBench;
use ckpt_eval::experiments::formats::FormatsBench;
use ckpt_eval::experiments::interference::InterferenceBench;
use ckpt_eval::experiments::interval::IntervalBench;
use ckpt_eval::experiments::overhead::OverheadBench;
use ckpt_eval::experiments::pytrain::PyTrainBench;
use ckpt_eval::experiments::sharded::ShardedBench;
use ckpt_eval::experiments::Ctx;
use ckpt_eval::limits::Limits;
use ckpt_eval::models::{DtypeMix, ModelState};
use ckpt_eval::stats::Summary;
use ckpt_eval::suite::{Cmd, Common, SuiteArgs};
use clap::Parser;

fn ctx(dir: &std::path::Path) -> Ctx {
    Ctx::new(
        dir.to_path_buf(),
        2,
        ckpt_eval::python::interpreter(),
        false,
    )
}

/// The command line of `ckpt-eval`, as its `main` puts it together.
#[derive(Parser)]
struct Cli {
    #[command(flatten)]
    common: Common,
    #[command(flatten)]
    suite: SuiteArgs,
    #[command(subcommand)]
    cmd: Option<Cmd>,
}

fn names(cli: &Cli) -> Vec<&'static str> {
    let list = match &cli.cmd {
        None => cli.suite.experiments(),
        Some(c) => c.experiments(&cli.suite),
    };
    list.iter().map(|e| e.name()).collect()
}

#[test]
fn the_suite_is_the_list_and_a_subcommand_runs_what_it_needs() {
    let all = Cli::parse_from(["ckpt-eval"]);
    assert_eq!(
        names(&all),
        [
            "engine",
            "formats",
            "overhead",
            "determinism",
            "interference",
            "interval",
            "scale",
            "sharded",
            "fsdp-scale",
            "python",
            "recovery",
            "memtier",
            "gpu",
            "s3"
        ]
    );
    // An experiment's options work both in the suite and after its subcommand.
    let one = Cli::parse_from(["ckpt-eval", "sharded", "--sharded-ranks", "2,4"]);
    assert_eq!(names(&one), ["sharded"]);
    let Some(Cmd::Sharded(s)) = &one.cmd else {
        panic!("not the sharded subcommand")
    };
    assert_eq!(s.sharded_ranks, Some(vec![2, 4]));
    let suite = Cli::parse_from(["ckpt-eval", "--sharded-ranks", "4"]);
    assert_eq!(suite.suite.sharded.sharded_ranks, Some(vec![4]));
    let fs = Cli::parse_from([
        "ckpt-eval",
        "fsdp-scale",
        "--fsdp-ranks",
        "4,8,16,32",
        "--fsdp-blocks",
        "400",
    ]);
    assert_eq!(names(&fs), ["fsdp-scale"]);
    let Some(Cmd::FsdpScale(f)) = &fs.cmd else {
        panic!("not the fsdp-scale subcommand")
    };
    assert_eq!(
        (f.fsdp_ranks.clone(), f.fsdp_blocks),
        (Some(vec![4, 8, 16, 32]), Some(400))
    );
    // interval reads the formats and overhead results: they run first.
    let iv = Cli::parse_from(["ckpt-eval", "interval", "--mtbf", "60"]);
    assert_eq!(names(&iv), ["formats", "overhead", "interval"]);
    // A GPU option reaches the script only when given.
    let gpu = Cli::parse_from(["ckpt-eval", "gpu", "--gpu-layers", "3"]);
    assert_eq!(names(&gpu), ["gpu"]);
}

fn state(mix: DtypeMix) -> ckpt_core::State {
    ModelState {
        model: "bert-large".into(),
        bytes: 2 << 20,
        mix,
        optimizer: true,
        seed: 5,
    }
    .build()
    .unwrap()
}

fn well_formed(s: &Summary, n: usize) {
    assert_eq!(s.n, n);
    assert!(s.min <= s.median && s.median <= s.max, "{s:?}");
    assert!(s.min.is_finite() && s.min >= 0.0, "{s:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn formats_rows_for_every_ckpt_format_and_every_baseline() {
    let dir = tempfile::tempdir().unwrap();
    let ctx = ctx(dir.path());
    let st = state(DtypeMix::Bf16);
    let lim = Limits::measure(&st, dir.path(), 1).unwrap();
    let bench = FormatsBench {
        zstd_levels: vec![0, 3],
    };
    let r = bench.run(&ctx, &st, &lim).await.unwrap();
    let names: Vec<&str> = r.rows.iter().map(|x| x.name.as_str()).collect();
    let formats = ckpt_formats::registry().names().len();
    assert_eq!(
        r.rows.iter().filter(|x| x.by == "ckpt").count(),
        formats + 1,
        "{names:?}"
    );
    assert!(names.contains(&"ckpt native") && names.contains(&"ckpt native zstd-3"));
    for x in &r.rows {
        well_formed(&x.save_s, 2);
        well_formed(&x.load_s, 2);
        assert!(
            x.stall_s.median <= x.save_s.max + 1e-9,
            "{}: stall after durable",
            x.name
        );
        assert!(
            x.bytes as f64 > 0.5 * r.state_bytes as f64,
            "{}: {} bytes",
            x.name,
            x.bytes
        );
        assert!(x.save_gbps > 0.0 && x.save_vs_floor > 0.0);
    }
    if ctx.python.is_some() {
        assert_eq!(r.python_error, None);
        for b in [
            "torch.save",
            "safetensors.torch",
            "dcp.save",
            "dcp.async_save",
            "h5py",
        ] {
            assert!(names.contains(&b), "missing baseline {b}: {names:?}");
        }
    } else {
        assert!(r.python_error.is_some());
    }
    assert_eq!(
        std::fs::read_dir(dir.path()).unwrap().count(),
        0,
        "scratch left behind"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn overhead_rows_and_interval_plans() {
    let dir = tempfile::tempdir().unwrap();
    let ctx = ctx(dir.path());
    let st = state(DtypeMix::Fp32);
    let bench = OverheadBench {
        steps: 4,
        every: 2,
        compute: Duration::from_millis(30),
    };
    let o = bench.run(&ctx, &st).await.unwrap();
    assert_eq!(o.rows[0].name, "no checkpoints");
    assert_eq!(o.rows[0].slowdown_pct, 0.0);
    let expect = if ctx.python.is_some() { 6 } else { 4 };
    assert_eq!(
        o.rows.len(),
        expect,
        "{:?}",
        o.rows.iter().map(|r| &r.name).collect::<Vec<_>>()
    );
    for r in &o.rows {
        // 4 steps of 30 ms at least.
        assert!(r.loop_s.min >= 0.12, "{}: {:?}", r.name, r.loop_s);
    }
    for r in &o.rows[1..4] {
        assert_eq!(r.stall_s.n, 4, "{}: two saves in each of two runs", r.name);
    }
    let blocking = &o.rows[1];
    assert!(blocking.stall_s.median > 0.0);

    let iv = IntervalBench {
        mtbf_s: 3600.0,
        restart_fixed_s: 10.0,
    }
    .run(&o, None);
    assert_eq!(iv.rows.len(), o.rows.len() - 1);
    for r in &iv.rows {
        let p = &r.plan;
        assert_eq!(r.restart_s, 10.0, "no formats results: the fixed part only");
        assert!((p.young_s - (2.0 * p.cost_s * 3600.0).sqrt()).abs() < 1e-9);
        assert!(p.goodput > 0.0 && p.goodput < 1.0);
        assert_eq!(r.curve.len(), 40);
        // Goodput at Daly's interval is within a hair of the best point of the curve.
        let best = r.curve.iter().map(|c| c.1).fold(0.0, f64::max);
        assert!(
            p.goodput >= best - 1e-3,
            "{}: {} < {best}",
            p.setup,
            p.goodput
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn determinism_checks_pass() {
    let dir = tempfile::tempdir().unwrap();
    let r = DeterminismBench {
        steps: 30,
        stop_at: 11,
    }
    .run(&ctx(dir.path()), &state(DtypeMix::Bf16))
    .await
    .unwrap();
    let torch = usize::from(ckpt_eval::python::interpreter().is_some());
    assert_eq!(
        r.checks.len(),
        ckpt_formats::registry().names().len() + 3 + torch
    );
    for c in &r.checks {
        assert!(c.identical, "{c:?}");
        assert!(c.compared > 0);
    }
    assert!(r.all_identical);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn interference_rows_for_quiet_and_each_noise() {
    let dir = tempfile::tempdir().unwrap();
    let mut c = ctx(dir.path());
    c.repeats = 1;
    let bench = InterferenceBench {
        intensity: 1,
        steps: 4,
        every: 2,
        kernel_iters: 100_000,
    };
    let r = bench.run(&c, &state(DtypeMix::Fp32)).await.unwrap();
    let names: Vec<&str> = r.rows.iter().map(|x| x.noise.as_str()).collect();
    assert_eq!(
        names,
        [
            "none",
            "memory bandwidth",
            "disk write+fsync",
            "cpu",
            "loopback network"
        ]
    );
    assert_eq!(r.rows[0].commit_vs_quiet, 1.0);
    assert_eq!(r.rows[0].noise_rate, 0.0);
    for x in &r.rows[1..] {
        assert!(x.noise_rate > 0.0, "{}: the noise did no work", x.noise);
        assert!(x.commit_vs_quiet > 0.0);
    }
    well_formed(&r.compute_loop_s, 1);
    assert_eq!(
        std::fs::read_dir(dir.path()).unwrap().count(),
        0,
        "scratch left behind"
    );
}

#[test]
fn sharded_rows_for_every_method_on_two_ranks() {
    let dir = tempfile::tempdir().unwrap();
    let mut c = ctx(dir.path());
    c.repeats = 1;
    let why = ckpt_eval::experiments::sharded::unavailable(c.python.as_deref());
    let Some(py) = c.python.clone().filter(|_| why.is_none()) else {
        assert!(why.is_some(), "a reason is given when it cannot run");
        return;
    };
    let bench = ShardedBench {
        ranks: vec![2],
        mib: 1.0,
        repeats: 1,
        timeout: Duration::from_secs(300),
    };
    let r = bench.run(&c, &py).unwrap();
    assert_eq!(r.runs.len(), 1);
    let run = &r.runs[0];
    assert_eq!(run.ranks, 2);
    assert!(run.hidden % 2 == 1 && run.local_bytes > 0);
    assert!(run.floors.write_fsync_s > 0.0 && run.floors.read_cold_s > 0.0);
    let names: Vec<&str> = run.rows.iter().map(|x| x.name.as_str()).collect();
    assert_eq!(
        names,
        [
            "ckpt eager",
            "ckpt lazy",
            "ckpt lazy (AppState)",
            "dcp.save",
            "dcp.async_save",
            "dcp.save -> ckpt",
            "dcp.async_save -> ckpt",
            "torch-checkpointing"
        ]
    );
    for x in &run.rows {
        if x.name.starts_with("ckpt") || x.name.starts_with("dcp") {
            assert!(x.skipped.is_none(), "{}: {:?}", x.name, x.skipped);
        }
        if x.skipped.is_some() {
            continue;
        }
        let (stall, durable) = (x.stall_s.as_ref().unwrap(), x.durable_s.as_ref().unwrap());
        well_formed(stall, 1);
        well_formed(durable, 1);
        well_formed(x.load_s.as_ref().unwrap(), 1);
        assert!(stall.median <= durable.median + 1e-9, "{}", x.name);
        // Each rank writes about its own shards, not the whole state.
        assert!(
            x.written_vs_local > 0.9 && x.written_vs_local < 1.5,
            "{}: {}",
            x.name,
            x.written_vs_local
        );
    }
    // Five targets per ckpt mode when every peer ran, and three of DCP
    // into ckpt's storage against DCP's own.
    if run.rows.iter().all(|x| x.skipped.is_none()) {
        assert_eq!(r.targets.len(), 13, "{:?}", r.targets);
        let into: Vec<&str> = r.targets[10..].iter().map(|t| t.what.as_str()).collect();
        assert!(into.iter().all(|w| w.contains("-> ckpt")), "{into:?}");
    }
}

/// The Python experiment at its smallest (`layers` blocks of width 64, or of
/// `experts` experts each), or None (with its reason checked) where it cannot run.
fn tiny_python(
    layers: usize,
    experts: usize,
) -> Option<ckpt_eval::experiments::pytrain::PyTrainResults> {
    let dir = tempfile::tempdir().unwrap();
    let c = ctx(dir.path());
    let why = ckpt_eval::experiments::pytrain::unavailable(c.python.as_deref());
    let Some(py) = c.python.clone().filter(|_| why.is_none()) else {
        assert!(why.is_some(), "a reason is given when it cannot run");
        return None;
    };
    let bench = PyTrainBench {
        layers,
        width: 64,
        seq: 16,
        batch: 1,
        repeats: 1,
        rounds: 1,
        every: 1,
        experts,
        timeout: Duration::from_secs(300),
    };
    Some(bench.run(&c, &py).unwrap())
}

#[test]
fn python_rows_for_every_method_and_the_training_loop() {
    let Some(r) = tiny_python(1, 0) else {
        return;
    };
    assert!(
        r.state_bytes > 3 * 4 * r.params / 2 && r.tensors > 10,
        "{r:?}"
    );
    assert!(
        r.model.contains("GPT2") || r.model.contains("GPT-2"),
        "{}",
        r.model
    );
    assert!(r.floors.memcpy_s > 0.0 && r.floors.write_fsync_s > 0.0 && r.floors.read_cold_s > 0.0);
    let names: Vec<&str> = r.methods.iter().map(|x| x.name.as_str()).collect();
    assert_eq!(
        names,
        [
            "ckpt eager",
            "ckpt lazy",
            "torch.save",
            "safetensors",
            "dcp.save",
            "dcp.async_save",
            "torch-checkpointing"
        ]
    );
    for x in &r.methods {
        if x.name.starts_with("ckpt") || x.name.starts_with("dcp") || x.name == "torch.save" {
            assert!(x.skipped.is_none(), "{}: {:?}", x.name, x.skipped);
        }
        if x.skipped.is_some() {
            continue;
        }
        let (stall, durable) = (x.stall_s.as_ref().unwrap(), x.durable_s.as_ref().unwrap());
        // A job's first save right after its first step, timed apart.
        assert!(x.first_stall_s.is_some_and(|s| s > 0.0), "{}", x.name);
        well_formed(stall, 1);
        well_formed(durable, 1);
        assert!(stall.median <= durable.median + 1e-9, "{}", x.name);
        // One load per file format: ckpt lazy and dcp.async_save share another's.
        let loads = !matches!(x.name.as_str(), "ckpt lazy" | "dcp.async_save");
        assert_eq!(x.load_s.is_some(), loads, "{}", x.name);
        assert_eq!(x.peak_load_extra_bytes.is_some(), loads, "{}", x.name);
        assert!(
            x.written_bytes as f64 > 0.9 * r.state_bytes as f64,
            "{}",
            x.name
        );
    }
    let looped: Vec<&str> = r.loops.iter().map(|x| x.name.as_str()).collect();
    assert_eq!(
        looped,
        ["ckpt eager", "ckpt lazy", "torch.save", "dcp.async_save"]
    );
    for l in &r.loops {
        assert_eq!(l.rounds, 1);
        assert!(l.ckpt_steps.median >= 1.0 && l.step_s.median > 0.0, "{l:?}");
        assert!(l.durable_s.median >= l.stall_s.median, "{l:?}");
        assert!(l.durable_vs_idle.is_some(), "{l:?}");
    }
    // Three on the load, two on the stall, four on the loop.
    assert_eq!(r.targets.len(), 9, "{:?}", r.targets);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn suite_report_holds_every_table_csv_and_plot() {
    let dir = tempfile::tempdir().unwrap();
    let scratch = dir.path().join("scratch");
    // The Python experiments are covered above; keep this one quick.
    let cli = Cli::parse_from([
        "ckpt-eval",
        "--quiet",
        "--no-python",
        "--repeats",
        "1",
        "--model",
        "resnet50",
        "--mib",
        "1",
        "--engine-mib",
        "1",
        "--engine-tensors",
        "8",
        "--zstd",
        "0,1",
        "--steps",
        "4",
        "--every",
        "2",
        "--compute-ms",
        "10",
        "--interference-mib",
        "1",
        "--mtbf",
        "600",
        "--restart",
        "5",
        "--ranks",
        "1,2",
        "--scale-mib",
        "1",
        "--sim-ranks",
        "4",
        "--sim-stored",
        "1,2",
        "--scratch",
        scratch.to_str().unwrap(),
    ]);
    let c = cli.common.ctx().unwrap();
    // The scale experiment runs under mpirun only with the rank program
    // (feature `mpi`), its simulated ranks always; recovery (a campaign) has
    // its own test below.
    let list: Vec<_> = cli
        .suite
        .experiments()
        .into_iter()
        .filter(|e| e.name() != "recovery")
        .collect();
    let r = ckpt_eval::suite::run(&c, &list).await;
    let errors: Vec<_> = r.errors().collect();
    assert!(errors.is_empty(), "{errors:?}");
    // sharded, fsdp-scale, python and memtier need Python, left out above; gpu needs its script
    // (and a device); s3 needs a server, named by no URL here.
    let not_run: Vec<&str> = r.not_run().map(|(w, _)| w).collect();
    assert_eq!(
        not_run,
        ["sharded", "fsdp-scale", "python", "memtier", "gpu", "s3"],
        "{:?}",
        r.not_run().collect::<Vec<_>>()
    );
    // ckpt's rows have loads into caller buffers too, and the native targets.
    let f = c
        .kept::<ckpt_eval::experiments::formats::FormatResults>()
        .expect("formats ran");
    for row in f.rows.iter().filter(|x| x.by == "ckpt") {
        let into = row.load_into_s.as_ref().expect("load_into timed");
        assert!(
            into.median > 0.0 && row.load_into_vs_floor.is_some(),
            "{row:?}"
        );
    }
    assert_eq!(f.targets.len(), 2, "{:?}", f.targets);
    let results = |name: &str| {
        &r.experiments
            .iter()
            .find(|e| e.name == name)
            .unwrap_or_else(|| panic!("{name} missing"))
            .output
            .results
    };
    if cfg!(feature = "mpi") {
        let scale = &results("scale")["mpirun"];
        let rows = scale["rows"].as_array().unwrap();
        assert_eq!(rows.len(), 4, "1 and 2 ranks, with and without dedup");
        let state = scale["state_bytes"].as_u64().unwrap();
        let written = |ranks: u64, dedup: bool| {
            rows.iter()
                .find(|x| x["ranks"] == ranks && x["dedup"] == dedup)
                .unwrap()["written_bytes"]
                .as_u64()
                .unwrap()
        };
        // Two ranks without dedup write two copies; with dedup, one (plus the
        // chunks' 64-byte headers).
        let copies = |bytes: u64, n: u64| bytes >= n * state && bytes < n * state + 4096;
        assert!(copies(written(2, false), 2), "{}", written(2, false));
        assert!(copies(written(2, true), 1), "{}", written(2, true));
        assert!(copies(written(1, true), 1), "{}", written(1, true));
    }
    let out = dir.path().join("run");
    ckpt_eval::report::write_all(&r, &out).unwrap();
    let json: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.join("results.json")).unwrap()).unwrap();
    assert!(json["limits"].is_object(), "results.json lacks the floors");
    for k in [
        "engine",
        "formats",
        "overhead",
        "determinism",
        "interference",
        "interval",
    ] {
        let e = json["experiments"]
            .as_array()
            .unwrap()
            .iter()
            .find(|e| e["name"] == k)
            .unwrap_or_else(|| panic!("results.json lacks {k}"));
        assert!(e["results"].is_object(), "results.json lacks {k}'s results");
    }
    let md = std::fs::read_to_string(out.join("report.md")).unwrap();
    // What did not run is said at the top, before any table.
    let first_table = md.find("\n## ").unwrap();
    assert!(md[..first_table].contains("not run: sharded"), "{md}");
    let mut tables = vec![
        "targets",
        "formats",
        "limits",
        "overhead",
        "determinism",
        "interference",
        "interval",
        "engine",
    ];
    if cfg!(feature = "mpi") {
        tables.push("scale");
    }
    tables.extend(["sim_scale", "sim_scale_load", "sim_scale_gc"]);
    // Every simulated rank's load came back as saved.
    let sim = &results("scale")["simulated"]["rows"][0]["run"];
    assert_eq!(sim["ranks"], 4);
    assert!(sim["load_same"]["checked_bytes"].as_u64().unwrap() > 0);
    for t in tables {
        let csv = std::fs::read_to_string(out.join(format!("{t}.csv"))).unwrap();
        assert!(csv.lines().count() >= 2, "{t}.csv has no rows");
        // Parsed as CSV: a header may hold a comma (quoted).
        let header: Vec<String> = csv::Reader::from_reader(csv.as_bytes())
            .headers()
            .unwrap()
            .iter()
            .map(ckpt_eval::table::md_escape)
            .collect();
        assert!(
            md.contains(&format!("| {} |", header.join(" | "))),
            "report.md lacks the {t} table"
        );
    }
    let plots: Vec<String> = std::fs::read_dir(out.join("plots"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    for name in &plots {
        assert!(name.ends_with(".svg"), "{name}");
        assert!(md.contains(&format!("plots/{name}")), "{name} not embedded");
    }
    // report.html: every plot inline, nothing to fetch.
    let html = std::fs::read_to_string(out.join("report.html")).unwrap();
    assert_eq!(html.matches("<svg").count(), plots.len());
    assert!(!html.contains("src=") && html.contains("<table>"));
    let expected = if cfg!(feature = "mpi") { 9 } else { 8 };
    assert!(plots.len() >= expected, "{plots:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn recovery_restarts_or_why_not() {
    use ckpt_eval::experiments::recovery::Recovery;
    use ckpt_eval::experiments::Experiment;
    let dir = tempfile::tempdir().unwrap();
    let c = ctx(dir.path());
    let e = Recovery {
        recovery_kills: Some(2),
    };
    if let Some(why) = e.unavailable(&c) {
        // The victim is a PyTorch script: without the venv it cannot run.
        assert!(why.contains("Python") || why.contains("import"), "{why}");
        return;
    }
    let out = e.run(&c).await.unwrap();
    let t = &out.tables[0];
    assert_eq!(t.id, "recovery");
    assert_eq!(t.rows[0][0], "restart: spawn to first new step");
    assert!(
        !t.rows[0][1].is_empty() && !t.rows[1][1].is_empty(),
        "{t:?}"
    );
    // Nothing torn loaded, every restart where the oracle says, finals identical.
    assert_eq!(out.targets.len(), 3);
    assert!(out.targets.iter().all(|x| x.met), "{:?}", out.targets);
    assert!(out.results["failures_total"].as_u64().unwrap() >= 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memtier_restarts_from_every_source_or_why_not() {
    use ckpt_eval::experiments::memtier::Memtier;
    use ckpt_eval::experiments::Experiment;
    let dir = tempfile::tempdir().unwrap();
    let c = ctx(dir.path());
    let e = Memtier {
        memtier_mib: Some(16),
        memtier_repeats: Some(1),
        memtier_episodes: Some(0),
        memtier_loop_rounds: Some(1),
    };
    if let Some(why) = e.unavailable(&c) {
        assert!(c.python.is_none() || why.contains("import"), "{why}");
        return;
    }
    let out = e.run(&c).await.unwrap();
    let t = &out.tables[0];
    assert_eq!(t.id, "memtier");
    // No S3 URL: the five other sources, each restored bitwise from where it says.
    assert_eq!(t.rows.len(), 5, "{t:?}");
    assert_eq!(t.rows[1][6], "memory, peer");
    assert_eq!(
        t.rows[2][6], "memory, merged",
        "one rank fewer, from memory"
    );
    assert_eq!(t.rows[3][3], "1.00", "disk cold is the baseline");
    assert!(t.rows.iter().all(|r| r[7] == "1/1"), "{t:?}");
    assert!(out.targets[0].met);
    let s = out.tables.iter().find(|t| t.id == "memtier-save").unwrap();
    assert_eq!(s.rows.len(), 3, "{s:?}");
    assert_eq!(s.rows[2][3], "1.00", "the plain disk save is the baseline");
    let lazy = out.tables.iter().find(|t| t.id == "memtier-lazy").unwrap();
    assert_eq!(lazy.rows.len(), 2, "{lazy:?}");
    // The loop ran as a 2-rank job the script started itself.
    let l = out.tables.iter().find(|t| t.id == "memtier-loop").unwrap();
    assert_eq!(l.rows.len(), 2, "{l:?}");
    assert_eq!(
        l.rows[1][3], "1.00",
        "the loop without replication is the baseline"
    );
    assert!(out
        .targets
        .iter()
        .any(|t| t.what.contains("with replication")));
    assert!(out.notes[0].contains("S3"), "{:?}", out.notes);
    assert!(
        !dir.path().join("memtier").exists(),
        "its scratch is removed"
    );
}

/// Runs one of the GPU scripts on CPU with a tiny GPT (`--device cpu`),
/// its work under `dir` and its JSON at `json`, and `extra` arguments; false
/// (the test has nothing to check) where this machine's Python lacks torch or
/// the ckpt package.
fn gpu_script_on_cpu(
    script: &std::path::Path,
    dir: &std::path::Path,
    json: &std::path::Path,
    extra: &[&str],
) -> bool {
    let Some(py) = ckpt_eval::python::interpreter() else {
        return false;
    };
    let out = std::process::Command::new(py)
        .arg(script)
        .args(["--device", "cpu", "--layers", "1", "--width", "64"])
        .args(["--seq", "16", "--batch", "2", "--vocab", "128"])
        .args(extra)
        .arg("--dir")
        .arg(dir.join("work"))
        .arg("--json")
        .arg(json)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    if stderr.contains("No module named") {
        return false; // no torch (or no ckpt package) in this interpreter
    }
    assert!(out.status.success(), "{}: {stderr}", script.display());
    true
}

/// `gpu_bench.py` needs CUDA for its figures, but its structure (the peers of
/// `peers.py`, the loop, the restores, the JSON the gpu experiment renders)
/// runs on CPU with `--device cpu`: every method, a tiny model.
#[test]
fn gpu_script_on_cpu_writes_what_the_gpu_experiment_renders() {
    use ckpt_eval::experiments::gpu::{render, script_path, GpuResults};
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("gpu.json");
    let extra = ["--every", "2", "--rounds", "2", "--restore-repeats", "2"];
    if !gpu_script_on_cpu(&script_path(), dir.path(), &json, &extra) {
        return;
    }
    let r: GpuResults = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    let names: Vec<&str> = r.methods.iter().map(|m| m.method.as_str()).collect();
    assert_eq!(
        names,
        [
            "none",
            "ckpt eager",
            "ckpt eager (locked ahead)",
            "ckpt lazy",
            "ckpt lazy (device staging)",
            "ckpt lazy (half staged)",
            "ckpt lazy (memory tier)",
            "torch.save",
            "dcp.save",
            "dcp.async_save",
            "torch-checkpointing"
        ]
    );
    for m in &r.methods[1..] {
        if m.method == "torch-checkpointing" && m.error.is_some() {
            continue; // not installed
        }
        assert_eq!(m.error, None, "{}", m.method);
        assert!(m.restore_cold_s.unwrap() > 0.0, "{}", m.method);
        assert!(m.durable_s.unwrap() > 0.0, "{}", m.method);
    }
    // The lazy pre-hooks' and DCP's staging waits are timed, torch.save has none.
    let waited = |name: &str| {
        r.methods
            .iter()
            .find(|m| m.method == name)
            .unwrap()
            .step_wait_s
            .is_some()
    };
    assert!(waited("ckpt lazy") && waited("ckpt lazy (device staging)"));
    assert!(waited("ckpt lazy (memory tier)") && waited("dcp.async_save"));
    assert!(!waited("torch.save"));
    // Every method that ran, the control included, says where its slowdown went.
    let ran = r.methods.iter().filter(|m| m.error.is_none()).count();
    assert!(r
        .methods
        .iter()
        .all(|m| m.error.is_some() || m.step_excess.is_some()));
    // And its first step, where ckpt readies its first save after a fresh start.
    assert!(r
        .methods
        .iter()
        .all(|m| m.error.is_some() || m.first_step_s.is_some_and(|s| s > 0.0)));
    // ckpt's own restores say where their time went (Checkpointer.last_restore).
    let raw: serde_json::Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    for m in raw["methods"].as_array().unwrap() {
        let name = m["method"].as_str().unwrap();
        if ["ckpt eager", "ckpt lazy", "ckpt lazy (device staging)"].contains(&name) {
            for kind in ["warm", "cold"] {
                let p = &m[format!("restore_{kind}_phases")];
                let (read, total) = (p["read"].as_f64().unwrap(), p["total"].as_f64().unwrap());
                assert!(read > 0.0 && total >= read, "{name} {kind}: {p}");
                // Each way restored twice; the figure is one of those runs.
                let runs = m[format!("restore_{kind}_runs_s")].as_array().unwrap();
                let figure = m[format!("restore_{kind}_s")].as_f64().unwrap();
                assert_eq!(runs.len(), 2, "{name} {kind}");
                assert!(
                    runs.iter().any(|r| r.as_f64() == Some(figure)),
                    "{name} {kind}"
                );
            }
        }
    }
    let o = render(&r);
    assert_eq!(o.tables[0].rows.len(), names.len());
    let steps = o.tables.iter().find(|t| t.id == "gpu-steps").unwrap();
    assert_eq!(steps.rows.len(), ran);
    assert!(!o.targets.is_empty());
}

/// `gpu_stall.py`, the GPU run's diagnosis of a save's stall, and
/// `scripts/gpu_summary.py`, which prints what a GPU run measured, run on CPU
/// (a tiny model) so that a lent GPU's minutes are not spent on a broken
/// script: each mode's stalls and phases, and a fresh start's save right
/// after its first step.
#[test]
fn gpu_stall_script_on_cpu_writes_what_the_gpu_summary_prints() {
    use ckpt_eval::experiments::gpu::script_path;
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("stall-fused.json");
    let script = script_path().with_file_name("gpu_stall.py");
    if !gpu_script_on_cpu(&script, dir.path(), &json, &["--saves", "2"]) {
        return;
    }
    let py = ckpt_eval::python::interpreter().unwrap();
    let r: serde_json::Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    for mode in ["lazy", "eager"] {
        let m = &r[mode];
        assert!(m["first_ms"].as_f64().unwrap() > 0.0, "{mode}: {m}");
        assert!(m["later_ms"].as_f64().unwrap() > 0.0, "{mode}: {m}");
        let e = &r[format!("early_{mode}")];
        for k in ["first_step_ms", "stall_ms", "next_step_ms", "plain_step_ms"] {
            assert!(e[k].as_f64().unwrap() > 0.0, "{mode} {k}: {e}");
        }
    }
    let summary =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/gpu_summary.py");
    let out = std::process::Command::new(&py)
        .arg(summary)
        .arg(dir.path())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    for mode in ["lazy", "eager"] {
        assert!(
            text.contains(&format!(
                "{mode}, a fresh start's save right after its first step"
            )),
            "{text}"
        );
    }
}

#[test]
fn python_runs_a_mixture_of_experts_of_many_small_tensors() {
    let Some(r) = tiny_python(2, 8) else {
        return;
    };
    assert!(r.model.contains("8 experts"), "{}", r.model);
    // Per layer a norm (2), a router and 8 experts of 3 projections (27);
    // the embedding and final norm: 57 parameters, each with AdamW's two
    // moments and step, and the state dict's 58 keys (the tied head's too).
    assert_eq!(r.tensors, 58 + 57 * 3, "{r:?}");
    let ckpt = r.methods.iter().find(|m| m.name == "ckpt lazy").unwrap();
    assert!(ckpt.skipped.is_none() && ckpt.stall_s.is_some(), "{ckpt:?}");
}
