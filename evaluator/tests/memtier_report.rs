//! The memory-tier experiment's rendering of what its scripts wrote, from
//! fixtures of their JSON, written by `memtier_bench.py` (a 2-rank job of
//! 128 MiB per rank, 2 restarts per source, S3 on a Garage node on loopback)
//! on a busy 2-core machine, `memtier_campaign.py` (8 episodes, a save every 4
//! steps, seed 4242) on a quiet one, and by
//! `memtier_bench.py --loop` (3 rounds of 40 steps of 100 ms, 2 ranks).

use ckpt_eval::experiments::memtier::render;
use ckpt_eval::experiments::memtier::results::{
    BenchResults, CampaignResults, LoopResults, MemtierResults,
};

fn read<T: serde::de::DeserializeOwned>(name: &str) -> T {
    let path = format!("{}/tests/fixtures/{name}", env!("CARGO_MANIFEST_DIR"));
    serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap()
}

fn results(campaign: bool) -> MemtierResults {
    MemtierResults {
        bench: read::<BenchResults>("memtier_bench.json"),
        campaign: campaign.then(|| read::<CampaignResults>("memtier_campaign.json")),
        replication_loop: None,
        s3_not_run: None,
    }
}

#[test]
fn restarts_by_source_as_ratios_to_local_disk_cold() {
    let out = render(&results(false));
    let t = &out.tables[0];
    assert_eq!(t.id, "memtier");
    assert!(
        t.title.contains("2-rank") && t.title.contains("128 MiB") && t.title.contains("2 restarts"),
        "{}",
        t.title
    );
    // The save stall to memory Young/Daly is given: the median of the warm saves.
    assert!(t.title.contains("0.022 s"), "{}", t.title);
    let names: Vec<&str> = t.rows.iter().map(|r| r[0].as_str()).collect();
    assert_eq!(
        names,
        [
            "ckpt memory tier, own copy",
            "ckpt memory tier, peer's replica (a node lost)",
            "ckpt local disk, cold",
            "ckpt S3",
            "torch.load, local disk, cold",
        ]
    );
    // Medians of the two restarts, the ratios of medians to disk cold's.
    assert_eq!(t.rows[0][1], "3.122 [1.472-4.772]");
    assert_eq!(t.rows[0][3], "0.72");
    assert_eq!(t.rows[1][4], "1.97", "the peer's restore over disk cold's");
    assert_eq!(t.rows[2][3], "1.00");
    assert_eq!(t.rows[3][4], "4.63", "S3's restore over disk cold's");
    assert_eq!(t.rows[4][3], "0.97");
    // Goodput in percent, where each rank restored from, every restart bitwise.
    assert_eq!(t.rows[0][5], "99.802");
    assert_eq!(t.rows[1][6], "memory, peer");
    assert!(t.rows.iter().all(|r| r[7] == "2/2"), "{:?}", t.rows);
    assert_eq!(out.targets[0].ratio, 0.0);
    assert!(out.targets[0].met);
    // The restore within a restart, memory over disk cold, against the 0.3 bound.
    let within: f64 = t.rows[0][4].parse().unwrap();
    assert!(out.targets[1].what.contains("within a restart"));
    assert!((out.targets[1].ratio - within).abs() < 0.01);
    assert_eq!(out.targets[1].met, out.targets[1].ratio <= 0.3);
    // The in-process restores: memory over disk cold, against the same bound.
    let r = &out.tables[1];
    assert_eq!(r.id, "memtier-restore");
    assert_eq!(r.rows.len(), 3);
    assert_eq!(r.rows[0][2], "0.65");
    assert!((out.targets[2].ratio - 0.65).abs() < 0.01 && !out.targets[2].met);
    assert!(out.notes.is_empty(), "{:?}", out.notes);
    assert_eq!(out.results["bench"]["restart"]["ranks"], 2);
}

#[test]
fn the_campaign_and_a_missing_s3_source() {
    let mut res = results(true);
    res.s3_not_run = Some("no S3 URL given".into());
    res.bench.restart.runs.remove("s3");
    let out = render(&res);
    assert_eq!(out.tables[0].rows.len(), 4);
    assert!(!out.tables[0].rows.iter().any(|r| r[0] == "ckpt S3"));
    assert_eq!(
        out.notes,
        ["memtier: restart from S3 not run: no S3 URL given"]
    );
    let c = out.tables.last().unwrap();
    assert_eq!(c.id, "memtier-campaign");
    // 8 episodes, all bitwise, none torn; 4 with a rank restoring a peer's
    // replica: the 4 node failures, each wholly from peer replicas; one save
    // (4 steps) lost each time.
    assert_eq!(c.rows[0][..6], ["8", "8", "0", "4", "4 of 4", "4 [4]"]);
    let n = out.targets.len();
    let (torn, peer) = (&out.targets[n - 2], &out.targets[n - 1]);
    assert!(torn.what.contains("torn") && torn.met && torn.ratio == 0.0);
    assert!(
        peer.what.contains("not resumed from peer replicas") && peer.what.contains("every 4 steps")
    );
    assert!(peer.met && peer.ratio == 0.0 && peer.bound == 0.25);
}

#[test]
fn node_failures_that_went_back_to_the_durable_tier_miss_the_peer_share() {
    let mut res = results(true);
    let c = res.campaign.as_mut().unwrap();
    // Two of the four node failures resumed from the durable tier instead.
    c.node_failures_from_peer = 2;
    let out = render(&res);
    let row = &out.tables.last().unwrap().rows[0];
    assert_eq!(row[4], "2 of 4");
    let peer = out.targets.last().unwrap();
    assert!((peer.ratio - 0.5).abs() < 1e-9 && !peer.met, "{peer:?}");
}

#[test]
fn a_restart_that_is_not_bitwise_misses_its_target() {
    let mut res = results(false);
    res.bench.restart.runs.get_mut("peer").unwrap()[1].bitwise = false;
    let out = render(&res);
    assert_eq!(out.tables[0].rows[1][7], "1/2");
    assert_eq!(out.targets[0].ratio, 1.0);
    assert!(!out.targets[0].met);
}

#[test]
fn save_stalls_by_tier_as_ratios_to_a_plain_disk_save() {
    let mut res = results(false);
    // Stalls as the script records them (the first save cold), set here.
    for (k, v) in [
        ("memory", [0.9, 0.040, 0.042, 0.044]),
        ("memory and disk", [1.2, 0.044, 0.046, 0.048]),
        ("disk", [0.8, 0.040, 0.041, 0.042]),
    ] {
        res.bench.save_stalls_s.insert(k.into(), v.to_vec());
    }
    let out = render(&res);
    let t = out.tables.iter().find(|t| t.id == "memtier-save").unwrap();
    let rows: Vec<(&str, &str, &str)> = t
        .rows
        .iter()
        .map(|r| (r[0].as_str(), r[2].as_str(), r[3].as_str()))
        .collect();
    assert_eq!(
        rows,
        [
            ("ckpt memory tier alone", "0.900", "1.02"),
            (
                "ckpt memory tier and local disk (one snapshot)",
                "1.200",
                "1.12"
            ),
            ("ckpt local disk (plain checkpointer)", "0.800", "1.00"),
        ]
    );
    let target = out
        .targets
        .iter()
        .find(|t| t.what.contains("both tiers"))
        .unwrap();
    assert!((target.ratio - 0.046 / 0.041).abs() < 1e-9 && !target.met);
    // Without lazy saves measured: no lazy table, no lazy target.
    assert!(!out.tables.iter().any(|t| t.id == "memtier-lazy"));
    assert!(!out.targets.iter().any(|t| t.what.contains("lazy")));
    // Lazy saves until their snapshot: both tiers over a plain lazy save.
    for (k, v) in [
        ("memory and disk, lazy", [0.5, 0.250, 0.252, 0.260]),
        ("disk, lazy", [0.4, 0.244, 0.246, 0.250]),
    ] {
        res.bench.save_stalls_s.insert(k.into(), v.to_vec());
    }
    let out = render(&res);
    let t = out.tables.iter().find(|t| t.id == "memtier-lazy").unwrap();
    assert_eq!(t.rows.len(), 2);
    assert_eq!(
        t.rows[0][0],
        "ckpt memory tier and local disk (one snapshot), lazy"
    );
    assert_eq!(t.rows[0][2], "0.500");
    assert_eq!(t.rows[0][3], "1.02");
    assert_eq!(t.rows[1][3], "1.00");
    let target = out
        .targets
        .iter()
        .find(|t| t.what.contains("lazy save to both tiers"))
        .unwrap();
    assert!((target.ratio - 0.252 / 0.246).abs() < 1e-9 && target.met);
    // A script that did not measure them: no table, no target.
    let out = render(&results(false));
    assert!(!out.tables.iter().any(|t| t.id == "memtier-save"));
}

#[test]
fn the_loop_with_replication_as_a_ratio_to_the_loop_without() {
    let mut res = results(false);
    let l = read::<LoopResults>("memtier_loop.json");
    let (with, without) = (&l.seconds["replicated"], &l.seconds["memory only"]);
    res.replication_loop = Some(l.clone());
    let out = render(&res);
    let t = out.tables.iter().find(|t| t.id == "memtier-loop").unwrap();
    assert!(
        t.title.contains("2-rank")
            && t.title.contains("40 steps of 100 ms")
            && t.title.contains("64 MiB")
            && t.title.contains("every 5 steps")
            && t.title.contains("3 rounds"),
        "{}",
        t.title
    );
    let median = |v: &[f64]| {
        let mut v = v.to_vec();
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let r = median(with) / median(without);
    assert_eq!(
        t.rows[0][0],
        "ckpt memory tier, replicated to the peer node"
    );
    assert_eq!(t.rows[0][3], format!("{r:.2}"));
    assert_eq!(t.rows[1][3], "1.00");
    let target = out
        .targets
        .iter()
        .find(|t| t.what.contains("with replication / without"))
        .unwrap();
    assert!((target.ratio - r).abs() < 1e-12);
    assert_eq!(target.met, r <= 1.01);
    // A slower replicated loop misses the bound.
    let mut slow = l;
    for s in slow.seconds.get_mut("replicated").unwrap() {
        *s *= 1.05;
    }
    res.replication_loop = Some(slow);
    let out = render(&res);
    let target = out
        .targets
        .iter()
        .find(|t| t.what.contains("with replication / without"))
        .unwrap();
    assert!(!target.met);
    // Results without the loop: no table, no target.
    let out = render(&results(false));
    assert!(!out.tables.iter().any(|t| t.id == "memtier-loop"));
    assert!(!out.targets.iter().any(|t| t.what.contains("replication")));
}
