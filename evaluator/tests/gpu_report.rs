//! The GPU experiment's rendering of what `gpu_bench.py` writes, from
//! fixtures of its JSON (the script itself needs a CUDA device): the methods
//! table, the floors, the targets in the report's targets section, and a run
//! without a device listed at the top of the report as not run.
//! `gpu_bench_h100.json` is what the script wrote on an H100 (a small model,
//! without the ckpt package, so ckpt's row is its error).

use ckpt_eval::experiments::gpu::{render, GpuResults};
use ckpt_eval::suite::{Ran, SuiteResults};

fn read(name: &str) -> GpuResults {
    let path = format!("{}/tests/fixtures/{name}", env!("CARGO_MANIFEST_DIR"));
    serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap()
}

fn fixture() -> GpuResults {
    read("gpu_bench.json")
}

fn suite_of(r: &GpuResults) -> SuiteResults {
    let output = render(r);
    SuiteResults {
        experiments: vec![Ran {
            name: "gpu".into(),
            secs: 1.0,
            not_run: output.not_run.clone(),
            error: None,
            output,
        }],
        ..Default::default()
    }
}

#[test]
fn methods_floors_and_targets_are_rendered() {
    let out = render(&fixture());
    assert!(out.not_run.is_none());
    let t = &out.tables[0];
    assert!(t.title.contains("NVIDIA H100 80GB HBM3") && t.title.contains("torch 2.11.0"));
    assert!(t.title.contains("15.00 GiB of state"), "{}", t.title);
    assert!(
        t.title.contains("device to host 0.310 s") && t.title.contains("cold read 4.800 s"),
        "{}",
        t.title
    );
    assert_eq!(t.header.len(), 11);
    // Stalls in ms, slowdown in %, times in s, memory in GiB.
    assert_eq!(
        t.rows[0],
        [
            "ckpt lazy",
            "0.250",
            "41.20",
            "6.10",
            "12.30",
            "+2.1",
            "7.100",
            "1.900",
            "5.300",
            "16.00",
            "2.00"
        ]
    );
    // A measure a method did not have stays empty (the first step: JSON
    // written before it was measured).
    assert_eq!(t.rows[1][1], "");
    assert_eq!(t.rows[1][4], "");
    assert_eq!(t.rows[1][5], "+233.0");
    // A method that failed shows its error.
    assert_eq!(t.rows[2][0], "dcp.async_save");
    assert_eq!(t.rows[2][1], "failed: RuntimeError: out of pinned memory");
    assert_eq!(out.targets.len(), 2);
    assert!(out.targets[0].met && !out.targets[1].met);
    assert_eq!(out.results["methods"][0]["method"], "ckpt lazy");

    let dir = tempfile::tempdir().unwrap();
    ckpt_eval::report::write_all(&suite_of(&fixture()), dir.path()).unwrap();
    let md = std::fs::read_to_string(dir.path().join("report.md")).unwrap();
    assert!(
        md.contains("| gpu | lazy stall ≤ 10 ms | 0.006 | 0.01 | met |"),
        "{md}"
    );
    assert!(
        md.contains("| gpu | slowdown ≤ 1 % | 0.021 | 0.01 | NOT met |"),
        "{md}"
    );
    assert!(!md.contains("not run"), "{md}");
    let csv = std::fs::read_to_string(dir.path().join("gpu.csv")).unwrap();
    assert!(
        csv.starts_with("method,first step s,stall first ms,"),
        "{csv}"
    );
}

#[test]
fn where_ckpts_stall_went_is_a_table_of_its_own() {
    let out = render(&fixture());
    // Only the method that timed its phases has a row.
    assert_eq!(out.tables.len(), 3);
    let t = &out.tables[1];
    assert_eq!(t.id, "gpu-stall");
    assert_eq!(t.rows.len(), 1);
    assert_eq!(
        t.rows[0],
        [
            "ckpt lazy",
            "0.30",
            "2.70",
            "0.40",
            "1.10",
            "0.20",
            "0.40",
            "5.10",
            "6.10"
        ]
    );
    // Results written before the call's two ends were timed read as zero there.
    let older: ckpt_eval::experiments::gpu::GpuStallPhases = serde_json::from_str(
        r#"{"walk_s": 0.0027, "device_s": 0.0004, "engine_s": 0.0011, "other_s": 0.0009, "total_s": 0.0051}"#,
    )
    .unwrap();
    assert_eq!((older.before_s, older.after_s), (0.0, 0.0));
    // A run whose methods timed no phases has the methods table alone.
    assert_eq!(render(&read("gpu_bench_h100.json")).tables.len(), 1);
}

#[test]
fn where_the_slowdown_went_is_a_table_of_the_steps_after_a_save() {
    let out = render(&fixture());
    let t = out.tables.iter().find(|t| t.id == "gpu-steps").unwrap();
    assert_eq!(
        t.rows,
        [["ckpt lazy", "71.20", "8.10", "1.20", "2.10", "11.40"]]
    );
}

#[test]
fn without_a_device_it_is_listed_as_not_run_at_the_top() {
    let skipped: GpuResults = serde_json::from_str(
        r#"{"skipped": "no CUDA device (torch.cuda.is_available() is False)"}"#,
    )
    .unwrap();
    let out = render(&skipped);
    assert!(out.tables.is_empty() && out.targets.is_empty());
    let dir = tempfile::tempdir().unwrap();
    ckpt_eval::report::write_all(&suite_of(&skipped), dir.path()).unwrap();
    let md = std::fs::read_to_string(dir.path().join("report.md")).unwrap();
    let top = &md[..md.find("report.html").unwrap()];
    assert!(
        top.contains("not run: gpu: no CUDA device (torch.cuda.is\\_available() is False)"),
        "{md}"
    );
    let html = std::fs::read_to_string(dir.path().join("report.html")).unwrap();
    assert!(html.contains("<li>not run: gpu: no CUDA device"), "{html}");
}

#[test]
fn the_scripts_own_output_renders() {
    let r = read("gpu_bench_h100.json");
    let out = render(&r);
    let t = &out.tables[0];
    assert!(
        t.title.contains("NVIDIA H100 80GB HBM3") && t.title.contains("GPT 4 x 512"),
        "{}",
        t.title
    );
    assert!(t.title.contains("device to host 0.014 s"), "{}", t.title);
    let methods: Vec<&str> = t.rows.iter().map(|r| r[0].as_str()).collect();
    assert_eq!(
        methods,
        [
            "none",
            "ckpt lazy",
            "torch.save",
            "dcp.save",
            "dcp.async_save"
        ]
    );
    // The loop without checkpoints has a slowdown (the noise) and no stall.
    assert_eq!(t.rows[0][2], "");
    assert_eq!(t.rows[0][5], "+6.2");
    assert_eq!(
        t.rows[1][1],
        "failed: ModuleNotFoundError: No module named 'ckpt'"
    );
    assert_eq!(t.rows[2][2], "1000.27");
    assert_eq!(t.rows[2][6], "1.005");
    assert!(out.targets.is_empty() && out.not_run.is_none());
}
