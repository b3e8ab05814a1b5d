//! The sharded experiment's tables and charts.

use super::results::{ShardedResults, ShardedRow};
use crate::plot::{bar, Chart};
use crate::stats::Summary;
use crate::table::{mib, opt_ms, opt_secs, Table};

/// The sharded experiment: per method and rank count, its floors, its targets.
pub fn tables(sh: &ShardedResults) -> Vec<Table> {
    let mut t = Table::new(
        "sharded",
        format!(
            "Sharded state: an FSDP2 MLP ({} MiB of f32 parameters) plus AdamW, saved and loaded by each method on each rank count (torchrun, gloo, CPU, torch {}); slowest rank, median [min-max] of {} timed saves after a cold and a warm save (sampled for memory; the timed ones are not); stall = the call blocks, snapshot = until the state may change, durable = on disk with fsync; load into a fresh model, page cache dropped; ratios to the same run's floors",
            sh.runs.first().map_or(String::new(), |x| mib(x.param_bytes as f64)),
            sh.torch,
            sh.repeats
        ),
        &[
            "ranks", "method", "stall ms", "snapshot s", "durable s", "load s", "written/rank MiB",
            "peak extra MiB", "stall/memcpy", "durable/write", "load/read", "peak/local",
        ],
    );
    for run in &sh.runs {
        for x in &run.rows {
            if let Some(why) = &x.skipped {
                t.push_note_row(
                    vec![run.ranks.to_string(), x.name.clone()],
                    format!("skipped: {why}"),
                );
                continue;
            }
            t.rows.push(vec![
                run.ranks.to_string(),
                x.name.clone(),
                opt_ms(x.stall_s.as_ref()),
                opt_secs(x.snapshot_s.as_ref()),
                opt_secs(x.durable_s.as_ref()),
                opt_secs(x.load_s.as_ref()),
                mib(x.written_bytes as f64),
                mib(x.peak_extra_bytes as f64),
                format!("{:.2}", x.stall_vs_memcpy),
                format!("{:.2}", x.durable_vs_write),
                format!("{:.2}", x.load_vs_read),
                format!("{:.2}", x.peak_vs_local),
            ]);
        }
    }
    let mut f = Table::new(
        "sharded_floors",
        "Sharded state: the floors, per rank count (slowest rank's local model and optimizer shards)".into(),
        &["ranks", "local state MiB", "write + fsync s", "read s", "page cache", "memcpy s"],
    );
    for run in &sh.runs {
        let fl = &run.floors;
        f.rows.push(vec![
            run.ranks.to_string(),
            mib(run.local_bytes as f64),
            format!("{:.3}", fl.write_fsync_s),
            format!("{:.3}", fl.read_cold_s),
            fl.cache_drop.clone(),
            format!("{:.4}", fl.memcpy_s),
        ]);
    }
    vec![t, f]
}

/// Stall, time until durable and load, by rank count and method.
pub fn charts(sh: &ShardedResults) -> Vec<(String, Chart)> {
    let mut out = Vec::new();
    type Pick = fn(&ShardedRow) -> Option<&Summary>;
    let bars = |f: Pick| {
        sh.runs
            .iter()
            .flat_map(|run| run.rows.iter())
            .filter_map(|x| {
                f(x).map(|s| {
                    bar(
                        &format!("{}: {}", x.ranks, x.name),
                        s,
                        usize::from(!x.name.starts_with("ckpt")),
                    )
                })
            })
            .collect::<Vec<_>>()
    };
    for (name, title, f) in [
        (
            "sharded_stall",
            "Sharded state: stall (the save call blocks)",
            (|x| x.stall_s.as_ref()) as Pick,
        ),
        (
            "sharded_durable",
            "Sharded state: save until durable",
            (|x| x.durable_s.as_ref()) as Pick,
        ),
        (
            "sharded_load",
            "Sharded state: load (page cache dropped)",
            (|x| x.load_s.as_ref()) as Pick,
        ),
    ] {
        out.push((
            name.into(),
            Chart::Bars {
                title: title.into(),
                unit: "seconds, slowest rank; bars are ranks: method".into(),
                bars: bars(f),
                reference: None,
            },
        ));
    }
    out
}
