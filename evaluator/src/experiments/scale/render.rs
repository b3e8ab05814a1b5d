//! The simulation's tables, chart and targets.

use super::sim::{LoadFigures, RankRun};
use super::store::Requests;
use super::SimResults;
use crate::experiments::Target;
use crate::plot::Chart;
use crate::table::Table;

fn kib(b: f64) -> String {
    format!("{:.1}", b / 1024.0)
}

fn reqs(r: &Requests) -> String {
    format!("{}/{}/{}/{}/{}", r.get, r.put, r.list, r.delete, r.head)
}

/// Requests, and the objects the listings returned.
fn reqs_listed(r: &Requests) -> String {
    format!("{} ({} listed)", reqs(r), r.listed)
}

fn ran(sim: &SimResults) -> impl Iterator<Item = &RankRun> {
    sim.rows.iter().filter_map(|r| r.run.as_ref())
}

/// The saves, the loads, and retention.
pub fn tables(sim: &SimResults) -> Vec<Table> {
    let sh = &sim.bench.shape;
    let mut saves = Table::new(
        "sim_scale",
        format!(
            "Scale, simulated: ranks as tasks of one process, each a real checkpointer (native, keep_last={}) on one memory:// store; per rank {} sharded tensors (FSDP-like rows), {} replicated and 1 of its own ({} bytes). Save 1 first, saves 2 and 3 the same tensors with other bytes. Collective bytes: sent and received per rank (the most of any rank, and rank 0's); rank 0's largest receive in one collective is a proxy for its peak memory. Requests: get/put/list/delete/head",
            sh.keep_last,
            sh.state.sharded,
            sh.state.replicated,
            ran(sim).next().map_or(0, |r| r.rank_bytes)
        ),
        &[
            "ranks",
            "save",
            "sent/rank KiB",
            "recv/rank KiB",
            "rank 0 recv KiB",
            "rank 0 largest recv KiB",
            "sent + recv, other ranks (max) KiB",
            "requests (all ranks)",
            "requests/rank (max)",
            "commit s (slowest wait)",
            "wall s",
        ],
    );
    for row in &sim.rows {
        let Some(run) = &row.run else {
            let why = row.skipped.clone().unwrap_or_default();
            saves.push_note_row(vec![row.ranks.to_string()], why);
            continue;
        };
        for s in &run.saves {
            saves.rows.push(vec![
                run.ranks.to_string(),
                s.save.to_string(),
                kib(s.sent_max as f64),
                kib(s.received_max as f64),
                kib(s.rank0.received_bytes() as f64),
                kib(s.rank0.max_received_bytes() as f64),
                kib(s.others_max as f64),
                reqs(&s.requests),
                reqs(&s.requests_rank_max),
                format!("{:.3}", s.commit_s),
                format!("{:.3}", s.wall_s),
            ]);
        }
    }
    let mut loads = Table::new(
        "sim_scale_load",
        "Scale, simulated: the root's metadata (bytes of the newest checkpoint's objects under manifests/, and its largest fragment of records) and a load of the newest checkpoint by as many ranks as saved it and by half as many (each box two old pieces, every byte checked). Per rank: requests to open a read-only checkpointer (and the objects its listings returned), requests of the load (list the checkpoints, read the boxes), bytes read, and of them metadata (keys outside chunks/)".into(),
        &[
            "ranks saved",
            "root KiB",
            "largest fragment KiB",
            "loading ranks",
            "open requests/rank (max)",
            "load requests/rank (max)",
            "gets/rank (mean)",
            "read/rank KiB (max)",
            "read/rank KiB (mean)",
            "metadata read/rank KiB (max)",
            "metadata read/rank KiB (mean)",
            "wall s",
        ],
    );
    for run in ran(sim) {
        let mut push = |l: &LoadFigures| {
            loads.rows.push(vec![
                run.ranks.to_string(),
                kib(run.root_bytes as f64),
                kib(run.fragment_max_bytes as f64),
                l.ranks.to_string(),
                reqs_listed(&l.open_rank_max),
                reqs(&l.rank_max),
                format!("{:.1}", l.rank_mean[0]),
                kib(l.rank_max.get_bytes as f64),
                kib(l.rank_mean[3]),
                kib(l.meta_bytes_max as f64),
                kib(l.meta_bytes_mean),
                format!("{:.3}", l.wall_s),
            ]);
        };
        push(&run.load_same);
        if let Some(h) = &run.load_half {
            push(h);
        }
    }
    let mut gc = Table::new(
        "sim_scale_gc",
        "Scale, simulated: what retention and a restart ask of the store. By rank count: rank 0's requests after it put the manifest of saves 2 and 3 (fence check, retention, GC). By checkpoints stored (one rank, keep_last = K, the K+1-th commit retiring one): the same for that commit, and opening a fresh checkpointer and listing the committed checkpoints. Requests: get/put/list/delete/head".into(),
        &["ranks", "checkpoints stored", "after manifest: requests", "open + list: requests"],
    );
    for run in ran(sim) {
        for s in run.saves.iter().skip(1) {
            gc.rows.push(vec![
                run.ranks.to_string(),
                format!("{} (save {})", s.save.min(sh.keep_last), s.save),
                s.after_manifest
                    .as_ref()
                    .map_or_else(String::new, reqs_listed),
                String::new(),
            ]);
        }
    }
    for k in &sim.stored {
        gc.rows.push(vec![
            "1".into(),
            k.stored.to_string(),
            k.gc.as_ref().map_or_else(String::new, reqs_listed),
            reqs_listed(&k.open),
        ]);
    }
    vec![saves, loads, gc]
}

/// Bytes per rank as ranks grow.
pub fn chart(sim: &SimResults) -> Chart {
    let series = |f: &dyn Fn(&RankRun) -> Option<u64>| -> Vec<(f64, f64)> {
        ran(sim)
            .filter_map(|r| Some((r.ranks as f64, f(r)? as f64 / 1024.0)))
            .collect()
    };
    let save = |k: usize| move |r: &RankRun| r.saves.get(k).map(|s| s.received_max);
    Chart::Lines {
        title: "Simulated ranks: bytes per rank as the job grows".into(),
        x_label: "ranks".into(),
        y_label: "KiB".into(),
        log_x: true,
        series: vec![
            (
                "save 1: collective bytes received per rank (max)".into(),
                series(&save(0)),
            ),
            (
                "save 2: collective bytes received per rank (max)".into(),
                series(&save(1)),
            ),
            (
                "rank 0: largest receive in one collective (peak memory proxy)".into(),
                series(&|r| r.saves.iter().map(|s| s.rank0.max_received_bytes()).max()),
            ),
            (
                "load: metadata read per rank (max)".into(),
                series(&|r| Some(r.load_same.meta_bytes_max)),
            ),
        ],
    }
}

/// Reported, not asserted.
pub fn targets(sim: &SimResults) -> Vec<Target> {
    let mut out = Vec::new();
    let runs: Vec<&RankRun> = ran(sim).collect();
    let per_rank = |r: &RankRun| r.saves.get(1).map_or(0, |s| s.others_max) as f64;
    if let (Some(small), Some(large)) = (runs.first(), runs.last()) {
        if large.ranks > small.ranks {
            out.push(Target::new(
                format!(
                    "scale (simulated): save 2 collective bytes per rank (sent + received, the most of any rank but rank 0), {} ranks over {} ranks",
                    large.ranks, small.ranks
                ),
                per_rank(large) / per_rank(small).max(1.0),
                1.5,
            ));
        }
        out.push(Target::new(
            format!(
                "scale (simulated): metadata a same-shape restart read per rank (the most of any) over the root + 2× its largest fragment, {} ranks",
                large.ranks
            ),
            large.load_same.meta_bytes_max as f64
                / (large.root_bytes + 2 * large.fragment_max_bytes).max(1) as f64,
            1.0,
        ));
    }
    if let Some(b) = &sim.built_root {
        out.push(Target::new(
            format!(
                "scale: root of {} ranks × {} tensors each, MiB (built by the commit's code from one rank's tensors)",
                b.ranks, b.tensors
            ),
            b.bytes as f64 / (1u64 << 20) as f64,
            8.0,
        ));
    }
    if let (Some(few), Some(many)) = (sim.stored.first(), sim.stored.last()) {
        if many.stored > few.stored {
            out.push(Target::new(
                format!(
                    "scale (simulated): list requests opening a root of {} checkpoints over one of {}",
                    many.stored, few.stored
                ),
                many.open.list as f64 / (few.open.list as f64).max(1.0),
                1.0,
            ));
            let lists = |k: &super::StoredFigures| k.gc.map_or(0, |g| g.list) as f64;
            out.push(Target::new(
                format!(
                    "scale (simulated): list requests of a commit's GC with {} checkpoints stored over {}",
                    many.stored, few.stored
                ),
                lists(many) / lists(few).max(1.0),
                1.0,
            ));
        }
    }
    out
}
