//! The report's view of the memory tier's results: restarts by source, the
//! restores within a running process, the save stalls, the training loop
//! with and without replication, the campaign, and the targets.

use super::results::{LoopResults, MemtierResults, Restarts, BASELINE, SOURCES};
use crate::experiments::{Output, Target};
use crate::stats::Summary;
use crate::table::{opt_ratio, secs, Table};

/// Bound of the memory tier's in-process restore over local disk cold's
/// (medians): the memory tier's issue.
pub const RESTORE_BOUND: f64 = 0.3;

/// A source's row label: who restores, from where.
pub fn label(source: &str) -> &str {
    match source {
        "memory" => "ckpt memory tier, own copy",
        "peer" => "ckpt memory tier, peer's replica (a node lost)",
        "memory, fewer ranks" => "ckpt memory tier, restarted by one rank fewer (merged)",
        "disk cold" => "ckpt local disk, cold",
        "s3" => "ckpt S3",
        "torch.load cold" => "torch.load, local disk, cold",
        other => other,
    }
}

fn summary(v: &[f64]) -> Option<Summary> {
    (!v.is_empty()).then(|| Summary::of(v))
}

fn ratio(a: Option<&Summary>, b: Option<&Summary>) -> f64 {
    match (a, b) {
        (Some(a), Some(b)) if b.median > 0.0 => a.median / b.median,
        _ => f64::NAN,
    }
}

/// Restart to first step and restore within it, per source, in the table's order.
fn restart_table(r: &Restarts, res: &MemtierResults) -> Table {
    let b = &res.bench;
    let stall = summary(b.memory_save_stall_s.get(1..).unwrap_or(&[]));
    let mut t = Table::new(
        "memtier",
        format!(
            "Memory tier: a {}-rank data-parallel job (one rank per node, {:.0} MiB of state each) restarted after a failure, from the failure to its first training step, by source; median [min-max] of {} restarts, the slowest rank's restore within it; ratios of medians to ckpt local disk cold in this run (page cache dropped by {}); goodput by Young/Daly for an MTBF of {:.1} h and a save stall to memory of {} s",
            r.ranks,
            r.mib_per_rank,
            r.repeats,
            r.page_cache,
            b.mtbf_s / 3600.0,
            stall.map_or_else(|| "?".into(), |s| format!("{:.3}", s.median)),
        ),
        &[
            "source",
            "restart s",
            "restore s",
            "restart / disk cold",
            "restore / disk cold",
            "goodput %",
            "restored from",
            "bitwise",
        ],
    );
    let of = |source: &str, f: fn(&super::results::RestartRun) -> f64| {
        r.runs
            .get(source)
            .and_then(|v| summary(&v.iter().map(f).collect::<Vec<_>>()))
    };
    let (base_restart, base_restore) = (
        of(BASELINE, |x| x.to_first_step_s),
        of(BASELINE, |x| x.restore_s),
    );
    for source in SOURCES {
        let Some(runs) = r.runs.get(source) else {
            continue;
        };
        let (restart, restore) = (
            of(source, |x| x.to_first_step_s),
            of(source, |x| x.restore_s),
        );
        let mut from: Vec<&str> = runs
            .iter()
            .flat_map(|x| x.sources.iter().map(String::as_str))
            .collect();
        from.sort_unstable();
        from.dedup();
        t.rows.push(vec![
            label(source).to_owned(),
            restart.as_ref().map_or_else(String::new, secs),
            restore.as_ref().map_or_else(String::new, secs),
            opt_ratio(ratio(restart.as_ref(), base_restart.as_ref())),
            opt_ratio(ratio(restore.as_ref(), base_restore.as_ref())),
            b.goodput_young_daly
                .get(source)
                .map_or_else(String::new, |g| format!("{:.3}", g.goodput * 100.0)),
            from.join(", "),
            format!(
                "{}/{}",
                runs.iter().filter(|x| x.bitwise).count(),
                runs.len()
            ),
        ]);
    }
    t
}

/// The restores in a running process (a fresh checkpointer), if they ran.
fn restore_table(res: &MemtierResults) -> Option<Table> {
    let b = &res.bench;
    let get = |k: &str| b.seconds.get(k).and_then(|v| summary(v));
    let base = get(BASELINE)?;
    let mut t = Table::new(
        "memtier-restore",
        format!(
            "Memory tier: restore of {:.2} GiB in a running process by a fresh checkpointer, every restore checked equal; median [min-max] of {}; ratios of medians to ckpt local disk cold in this run (page cache dropped by {})",
            b.gib,
            base.n,
            b.page_cache
        ),
        &["source", "restore s", "/ disk cold"],
    );
    for source in SOURCES {
        if let Some(s) = get(source) {
            t.rows.push(vec![
                label(source).to_owned(),
                secs(&s),
                opt_ratio(ratio(Some(&s), Some(&base))),
            ]);
        }
    }
    Some(t)
}

/// Bound of a save's stall to both tiers over a plain save's to local disk:
/// one snapshot serves both tiers.
pub const BOTH_TIERS_BOUND: f64 = 1.1;

/// Where the saves of the stall table went, in its order.
const SAVED_TO: [(&str, &str); 3] = [
    ("memory", "ckpt memory tier alone"),
    (
        "memory and disk",
        "ckpt memory tier and local disk (one snapshot)",
    ),
    ("disk", "ckpt local disk (plain checkpointer)"),
];

/// A table of saves' stalls by where they went: the median of the later
/// saves (each list's first, the process's cold one, apart), and its ratio to
/// the `base` save's; with the ratio of the `both` saves (to both tiers).
struct ByDestination {
    id: &'static str,
    title: String,
    stall: &'static str,
    rows: &'static [(&'static str, &'static str)],
    base: &'static str,
    both: &'static str,
}

fn by_destination(res: &MemtierResults, d: ByDestination) -> Option<(Table, f64)> {
    let stalls = &res.bench.save_stalls_s;
    let later = |k: &str| {
        stalls
            .get(k)
            .and_then(|v| summary(v.get(1..).unwrap_or(&[])))
    };
    let base = later(d.base)?;
    let mut t = Table::new(
        d.id,
        d.title,
        &["saved to", d.stall, "first save s", "/ disk"],
    );
    for &(key, label) in d.rows {
        let Some(s) = later(key) else { continue };
        let first = stalls.get(key).and_then(|v| v.first().copied());
        t.rows.push(vec![
            label.to_owned(),
            secs(&s),
            first.map_or_else(String::new, |f| format!("{f:.3}")),
            opt_ratio(ratio(Some(&s), Some(&base))),
        ]);
    }
    let both = ratio(later(d.both).as_ref(), Some(&base));
    Some((t, both))
}

/// The stalls of eager saves by where they went, if measured, against the
/// plain disk save's.
fn stall_table(res: &MemtierResults) -> Option<(Table, f64)> {
    by_destination(
        res,
        ByDestination {
            id: "memtier-save",
            title: format!(
                "Memory tier: stall of an eager save of {:.2} GiB by where it goes; median [min-max] of the later saves of interleaved rounds (a fresh checkpointer each), the process's first save (cold) apart; ratio of medians to the plain save to local disk in this run",
                res.bench.gib
            ),
            stall: "stall s",
            rows: &SAVED_TO,
            base: "disk",
            both: "memory and disk",
        },
    )
}

/// Lazy saves, until the snapshot is taken, by where they went, in the table's order.
const LAZY_SAVED_TO: [(&str, &str); 2] = [
    (
        "memory and disk, lazy",
        "ckpt memory tier and local disk (one snapshot), lazy",
    ),
    ("disk, lazy", "ckpt local disk (plain checkpointer), lazy"),
];

/// Lazy saves until their snapshot is taken, if measured: to both tiers
/// against a plain lazy save to local disk (medians of the later saves).
fn lazy_table(res: &MemtierResults) -> Option<(Table, f64)> {
    by_destination(
        res,
        ByDestination {
            id: "memtier-lazy",
            title: format!(
                "Memory tier: a lazy save of {:.2} GiB (a module's parameters and their optimizer) until its snapshot is taken (`save` + `wait_snapshot`: the most a training step waits for it), by where it goes; median [min-max] of the later saves of interleaved rounds, the process's first save apart; ratio of medians to the plain lazy save to local disk in this run",
                res.bench.gib
            ),
            stall: "until the snapshot s",
            rows: &LAZY_SAVED_TO,
            base: "disk, lazy",
            both: "memory and disk, lazy",
        },
    )
}

/// Bound of the training loop's time with replication over without: the
/// memory tier's issue (slowdown from replication <= 1 %).
pub const LOOP_BOUND: f64 = 1.01;

/// The loop with and without replication, and the ratio of their medians.
fn loop_table(l: &LoopResults) -> Option<(Table, f64)> {
    let get = |k: &str| l.seconds.get(k).and_then(|v| summary(v));
    let wait = |k: &str| l.final_wait_s.get(k).and_then(|v| summary(v));
    let base = get("memory only")?;
    let mut t = Table::new(
        "memtier-loop",
        format!(
            "Memory tier: a {}-rank training loop (one rank per node) of {} steps of {:.0} ms emulated compute, {}, {} MiB of state per rank saved to the memory tier every {} steps, with and without replication to the peer node, alternating; the slowest rank's time until its last step, median [min-max] of {} rounds, and its wait after it for the last save; ratio of medians to the loop without replication in this run",
            l.ranks,
            l.steps,
            l.compute_ms,
            l.compute,
            l.state_mib,
            l.every,
            base.n,
        ),
        &["saves", "loop s", "final wait s", "/ without replication"],
    );
    for (key, label) in [
        (
            "replicated",
            "ckpt memory tier, replicated to the peer node",
        ),
        ("memory only", "ckpt memory tier, not replicated"),
    ] {
        let Some(s) = get(key) else { continue };
        t.rows.push(vec![
            label.to_owned(),
            secs(&s),
            wait(key).as_ref().map_or_else(String::new, secs),
            opt_ratio(ratio(Some(&s), Some(&base))),
        ]);
    }
    Some((t, ratio(get("replicated").as_ref(), Some(&base))))
}

/// The memory tier's restarts (and restores, and campaign) for the report.
pub fn render(res: &MemtierResults) -> Output {
    let mut out = Output::of(res);
    let b = &res.bench;
    let r = &b.restart;
    out.tables.push(restart_table(r, res));
    let runs: Vec<_> = r.runs.values().flatten().collect();
    out.targets.push(Target::new(
        "memory tier: restarts whose state was not restored bitwise",
        runs.iter().filter(|x| !x.bitwise).count() as f64,
        0.0,
    ));
    // The issue's own measure: the restore within a restart (from
    // `load_latest` to the state in place), slowest rank, medians.
    let restore_of = |source: &str| {
        r.runs
            .get(source)
            .and_then(|v| summary(&v.iter().map(|x| x.restore_s).collect::<Vec<_>>()))
    };
    if let (Some(memory), Some(disk)) = (restore_of("memory"), restore_of(BASELINE)) {
        out.targets.push(Target::new(
            "memory tier: restore within a restart from memory / from local disk cold",
            ratio(Some(&memory), Some(&disk)),
            RESTORE_BOUND,
        ));
    }
    if let Some((t, both)) = stall_table(res) {
        out.tables.push(t);
        out.targets.push(Target::new(
            "memory tier: stall of a save to both tiers / a save to local disk",
            both,
            BOTH_TIERS_BOUND,
        ));
    }
    if let Some((t, both)) = lazy_table(res) {
        out.tables.push(t);
        out.targets.push(Target::new(
            "memory tier: lazy save to both tiers until its snapshot / a lazy save to local disk",
            both,
            BOTH_TIERS_BOUND,
        ));
    }
    if let Some(t) = restore_table(res) {
        let get = |k: &str| b.seconds.get(k).and_then(|v| summary(v));
        out.tables.push(t);
        out.targets.push(Target::new(
            "memory tier: restore from memory / local disk cold (in process)",
            ratio(get("memory").as_ref(), get(BASELINE).as_ref()),
            RESTORE_BOUND,
        ));
    }
    if let Some((t, r)) = res.replication_loop.as_ref().and_then(loop_table) {
        out.tables.push(t);
        out.targets.push(Target::new(
            "memory tier: training loop with replication / without (emulated compute)",
            r,
            LOOP_BOUND,
        ));
    }
    if let Some(c) = &res.campaign {
        let mut t = Table::new(
            "memtier-campaign",
            format!(
                "Memory tier fault campaign: {} episodes of a DDP job on simulated nodes ({} node failures, {} rank kills), a save every {} steps, every restart checked bitwise against what each rank logged; a node failure resumes from peer replicas when every rank of the lost node restored one; restart s from the kill to the slowest rank's first step, median [min-max]",
                c.episodes, c.node_failures, c.rank_kills, c.save_every
            ),
            &[
                "episodes",
                "resumed bitwise",
                "torn or undetected",
                "from a peer's replica",
                "node failures from peer replicas",
                "steps lost, median [max]",
                "restart s",
                "restore s",
            ],
        );
        let d = &c.episodes_detail;
        let lost: Vec<f64> = d
            .iter()
            .filter_map(|e| e.steps_lost)
            .map(|x| x as f64)
            .collect();
        let restart = summary(
            &d.iter()
                .map(|e| e.restart_to_first_step_s)
                .collect::<Vec<_>>(),
        );
        let restore = summary(&d.iter().map(|e| e.restore_s).collect::<Vec<_>>());
        t.rows.push(vec![
            c.episodes.to_string(),
            c.resumed_bitwise.to_string(),
            c.torn_or_undetected.to_string(),
            c.from_peer_replicas.to_string(),
            format!("{} of {}", c.node_failures_from_peer, c.node_failures),
            summary(&lost).map_or_else(String::new, |s| format!("{:.0} [{:.0}]", s.median, s.max)),
            restart.as_ref().map_or_else(String::new, secs),
            restore.as_ref().map_or_else(String::new, secs),
        ]);
        out.tables.push(t);
        out.targets.push(Target::new(
            "memory tier campaign: episodes resumed torn or corrupt",
            c.torn_or_undetected as f64,
            0.0,
        ));
        if c.node_failures > 0 {
            out.targets.push(Target::new(
                format!(
                    "memory tier campaign: share of node failures not resumed from peer replicas (a save every {} steps)",
                    c.save_every
                ),
                1.0 - c.node_failures_from_peer as f64 / c.node_failures as f64,
                0.25,
            ));
        }
    }
    if let Some(why) = &res.s3_not_run {
        out.notes
            .push(format!("memtier: restart from S3 not run: {why}"));
    }
    out
}
