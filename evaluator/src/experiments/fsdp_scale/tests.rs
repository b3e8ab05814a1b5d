use super::*;
use crate::plot::Chart;

/// What rank 0 prints, with times `c` (ckpt save, later, load) and `d` (dcp save, load) at `ranks`.
fn line(ranks: u64, c: [f64; 3], d: [f64; 2], manifest: u64, meta: u64) -> Json {
    serde_json::json!({
        "ranks": ranks, "blocks": 4, "width": 16, "tensors_per_rank": 16, "repeats": 1,
        "torch": "x", "setup_s": 1.0,
        "ckpt": {"open_s": 0.1, "save_s": c[0], "later_save_s": c[1], "load_s": c[2], "close_s": 0.0,
                 "manifest_bytes": manifest, "manifests_total_bytes": 2 * manifest, "manifests": 2,
                 "data_metadata_bytes": 0, "data_metadata_objects": {}, "verified_tensors": 16,
                 "runs": [{"open_s": 0.1, "save_s": c[0], "later_save_s": c[1], "load_s": c[2]}]},
        "dcp": {"save_s": d[0], "load_s": d[1], "metadata_bytes": meta,
                "runs": [{"save_s": d[0], "load_s": d[1]}]},
    })
}

#[test]
fn slope_of_a_power_law_is_its_exponent() {
    let pts: Vec<(f64, f64)> = [4.0, 8.0, 16.0, 32.0]
        .iter()
        .map(|&x: &f64| (x, 3.0 * x.powf(1.5)))
        .collect();
    assert!((log_log_slope(&pts).unwrap() - 1.5).abs() < 1e-9);
    assert!(log_log_slope(&[(4.0, 1.0)]).is_none(), "one rank count");
    assert!(
        log_log_slope(&[(4.0, 1.0), (4.0, 2.0)]).is_none(),
        "one distinct rank count"
    );
    assert!(log_log_slope(&[(4.0, 1.0), (8.0, 0.0)]).is_none(), "a zero");
}

#[test]
fn parses_runs_and_judges_the_targets() {
    // ckpt: save grows as ranks^2 from 0.1 s, load as ranks^1 from 0.2 s;
    // DCP: both linear from 1 s. At 8 ranks: save 0.4 / 2, load 0.4 / 2.
    let runs: Vec<FsdpScaleRun> = [
        line(4, [0.1, 0.05, 0.2], [1.0, 1.0], 1000, 800),
        line(8, [0.4, 0.2, 0.4], [2.0, 2.0], 2000, 1600),
    ]
    .iter()
    .map(|v| parse_run(v).unwrap())
    .collect();
    assert_eq!(runs[1].ranks, 8);
    assert_eq!(runs[1].manifest_bytes, 2000);
    assert_eq!(runs[1].manifests_total_bytes, 4000);
    assert_eq!(runs[0].dcp_metadata_bytes, 800);
    let s = slopes(&runs);
    let get = |w: &str| s.iter().find(|x| x.what == w).unwrap();
    assert!((get("save").ckpt - 2.0).abs() < 1e-9 && (get("save").dcp - 1.0).abs() < 1e-9);
    assert!((get("load").ckpt - 1.0).abs() < 1e-9);
    assert!((get("metadata bytes").ckpt - 1.0).abs() < 1e-9);
    let t = targets(&runs, &s);
    assert_eq!(t.len(), 4, "{t:?}");
    // Save grows faster than DCP's: missed; load as fast: met (bound inclusive).
    assert!(!t[0].met && t[0].what.contains("save"));
    assert!(t[1].met && t[1].what.contains("load"));
    // At 8 ranks: 0.4 / 2.0 = 0.2 for both, within 0.3.
    assert!(t[2].met && (t[2].ratio - 0.2).abs() < 1e-12, "{:?}", t[2]);
    assert!(t[3].met && t[3].what.starts_with("8 ranks"));
}

#[test]
fn a_run_without_its_figures_is_refused() {
    let mut v = line(4, [0.1, 0.1, 0.1], [1.0, 1.0], 10, 10);
    v["dcp"]["runs"] = serde_json::json!([]);
    assert!(parse_run(&v).is_err());
    let mut v = line(4, [0.1, 0.1, 0.1], [1.0, 1.0], 10, 10);
    v["ckpt"].as_object_mut().unwrap().remove("manifest_bytes");
    assert!(parse_run(&v).is_err());
}

#[test]
fn renders_a_row_per_rank_count_and_a_slope_per_quantity() {
    let runs: Vec<FsdpScaleRun> = [4, 8, 16]
        .iter()
        .map(|&n| {
            let f = n as f64;
            parse_run(&line(
                n,
                [0.01 * f, 0.01 * f, 0.02 * f],
                [0.1 * f, 0.1 * f],
                100 * n,
                60 * n,
            ))
            .unwrap()
        })
        .collect();
    let s = slopes(&runs);
    let r = FsdpScaleResults {
        torch: "x".into(),
        blocks: 4,
        width: 16,
        repeats: 1,
        targets: targets(&runs, &s),
        slopes: s,
        runs,
        failed: None,
    };
    let t = tables(&r);
    assert_eq!(t[0].rows.len(), 3);
    assert_eq!(t[0].rows[2][0], "16");
    assert_eq!(t[0].rows[2][8], "0.10", "save ckpt/dcp at 16 ranks");
    assert_eq!(t[1].rows.len(), 4);
    let c = charts(&r);
    assert_eq!(c.len(), 1);
    match &c[0].1 {
        Chart::Lines { series, log_x, .. } => {
            assert!(*log_x);
            assert_eq!(series.len(), 5);
            assert!(series.iter().all(|(_, p)| p.len() == 3));
        }
        other => panic!("not lines: {other:?}"),
    }
}

#[test]
fn a_job_counts_only_when_it_succeeded_and_printed_its_line() {
    let v = line(4, [0.1, 0.1, 0.1], [1.0, 1.0], 10, 10).to_string();
    let out = format!("a warning\n{v}\n");
    let (_, run) = parse_job(true, &out, "").unwrap();
    assert_eq!(run.ranks, 4);
    let failed = parse_job(false, &out, "Traceback: rank 3")
        .unwrap_err()
        .to_string();
    assert!(failed.contains("rank 3"), "{failed}");
    assert!(parse_job(true, "no line\n", "").is_err());
}
