//! Output of a suite run: tables (terminal and Markdown), `results.json`, one CSV
//! per table, plots (SVG, whose text the viewer sets in real fonts, and a PNG
//! fallback), `report.md` linking the SVGs and `report.html` with them inline
//! ([`crate::html`]), both opening with a summary figure (ckpt against each peer
//! on stall, time until durable and load), in one run directory.

use std::fmt::Write as _;
use std::path::Path;

use crate::experiments::engine::{EngineResults, Target};
use crate::experiments::pytrain::{PyMethodRow, PyTrainResults};
use crate::experiments::s3::S3Results;
use crate::experiments::sharded::{ShardedResults, ShardedRow};
use crate::limits::Limits;
use crate::plot::{Bar, Chart};
use crate::stats::Summary;
use crate::suite::SuiteResults;

/// A table: a title, a header and rows of cells.
#[derive(Debug, Clone)]
pub struct Table {
    /// File stem of its CSV.
    pub id: String,
    /// Title.
    pub title: String,
    /// Column names.
    pub header: Vec<String>,
    /// Rows.
    pub rows: Vec<Vec<String>>,
}

impl Table {
    fn new(id: &str, title: String, header: &[&str]) -> Table {
        Table {
            id: id.into(),
            title,
            header: header.iter().map(|s| s.to_string()).collect(),
            rows: vec![],
        }
    }

    /// Aligned plain text.
    pub fn to_text(&self) -> String {
        let n = self.header.len();
        let mut w = vec![0; n];
        for r in std::iter::once(&self.header).chain(&self.rows) {
            for (i, c) in r.iter().enumerate().take(n) {
                w[i] = w[i].max(c.chars().count());
            }
        }
        let line = |r: &Vec<String>| {
            r.iter()
                .enumerate()
                .map(|(i, c)| {
                    if i == 0 {
                        format!("{c:<width$}", width = w[i])
                    } else {
                        format!("{c:>width$}", width = w[i])
                    }
                })
                .collect::<Vec<_>>()
                .join("  ")
        };
        let mut s = format!("\n{}\n", self.title);
        s += &format!("  {}\n", line(&self.header));
        s += &format!(
            "  {}\n",
            w.iter()
                .map(|&k| "-".repeat(k))
                .collect::<Vec<_>>()
                .join("  ")
        );
        for r in &self.rows {
            s += &format!("  {}\n", line(r));
        }
        s
    }

    /// A Markdown table.
    pub fn to_markdown(&self) -> String {
        let mut s = format!(
            "| {} |\n|{}\n",
            self.header.join(" | "),
            " --- |".repeat(self.header.len())
        );
        for r in &self.rows {
            s += &format!("| {} |\n", r.join(" | "));
        }
        s
    }

    /// CSV (RFC 4180 quoting).
    pub fn to_csv(&self) -> String {
        let q = |c: &String| {
            if c.contains([',', '"', '\n']) {
                format!("\"{}\"", c.replace('"', "\"\""))
            } else {
                c.clone()
            }
        };
        std::iter::once(&self.header)
            .chain(&self.rows)
            .map(|r| r.iter().map(q).collect::<Vec<_>>().join(",") + "\n")
            .collect()
    }
}

/// `median [min-max]` of seconds.
pub fn secs(s: &Summary) -> String {
    format!("{:.3} [{:.3}-{:.3}]", s.median, s.min, s.max)
}

fn mib(b: f64) -> String {
    format!("{:.1}", b / (1u64 << 20) as f64)
}

/// Every table of the results, main one (formats) first.
pub fn tables(r: &SuiteResults) -> Vec<Table> {
    let mut out = Vec::new();
    if let Some(f) = &r.formats {
        let mut t = Table::new(
            "formats",
            format!(
                "Formats: {} MiB in {} tensors; median [min-max] of {} runs; save = until durable, load = page cache dropped; ckpt stalls here with the state shared as immutable bytes (the overhead table has the copying case)",
                mib(f.state_bytes as f64),
                f.tensors,
                f.rows.first().map_or(0, |x| x.save_s.n)
            ),
            &["setup", "save s", "stall s", "load s", "load_into s", "size MiB", "save GB/s", "load GB/s", "save/floor", "load/floor", "into/floor"],
        );
        for x in &f.rows {
            t.rows.push(vec![
                x.name.clone(),
                secs(&x.save_s),
                format!("{:.3}", x.stall_s.median),
                secs(&x.load_s),
                opt_secs(x.load_into_s.as_ref()),
                mib(x.bytes as f64),
                format!("{:.2}", x.save_gbps),
                format!("{:.2}", x.load_gbps),
                format!("{:.2}", x.save_vs_floor),
                format!("{:.2}", x.load_vs_floor),
                x.load_into_vs_floor
                    .map_or_else(|| "-".into(), |r| format!("{r:.2}")),
            ]);
        }
        out.push(t);
        if !f.targets.is_empty() {
            out.push(targets_table(
                "formats_targets",
                "Formats: the native format's targets, ratios of medians in the same run (reported, not asserted)",
                &f.targets,
            ));
        }
    }
    if let Some(l) = &r.limits {
        let mut t = Table::new(
            "limits",
            format!("Machine floors for the same {} MiB", mib(l.bytes as f64)),
            &["floor", "seconds", "GB/s"],
        );
        let read = if l.cache_dropped {
            "sequential read, page cache dropped"
        } else {
            "sequential read (page cache NOT dropped)"
        };
        for (name, s) in [
            ("memcpy (1 thread)", &l.memcpy_s),
            ("sequential write + fsync", &l.write_fsync_s),
            (read, &l.read_cold_s),
        ] {
            t.rows.push(vec![
                name.into(),
                secs(s),
                format!("{:.2}", Limits::gbps(l.bytes, s.median)),
            ]);
        }
        out.push(t);
    }
    if let Some(o) = &r.overhead {
        let mut t = Table::new(
            "overhead",
            format!(
                "Overhead: {} steps of {} ms emulated compute, a checkpoint every {} steps, {} MiB",
                o.steps,
                (o.compute_s * 1000.0).round(),
                o.every,
                mib(o.state_bytes as f64)
            ),
            &[
                "setup",
                "loop s",
                "stall/save s",
                "slowdown %",
                "peak extra MiB",
            ],
        );
        for x in &o.rows {
            t.rows.push(vec![
                x.name.clone(),
                secs(&x.loop_s),
                secs(&x.stall_s),
                format!("{:.1}", x.slowdown_pct),
                mib(x.peak_extra_bytes as f64),
            ]);
        }
        out.push(t);
    }
    if let Some(d) = &r.determinism {
        let mut t = Table::new(
            "determinism",
            "Determinism".into(),
            &["check", "compared", "identical", "detail"],
        );
        for c in &d.checks {
            t.rows.push(vec![
                c.what.clone(),
                c.compared.to_string(),
                if c.identical { "yes" } else { "NO" }.into(),
                c.detail.clone(),
            ]);
        }
        out.push(t);
    }
    if let Some(i) = &r.interference {
        let mut t = Table::new(
            "interference",
            format!(
                "Interference: eager save until committed, {} MiB, noise at {} thread(s)",
                mib(i.state_bytes as f64),
                i.intensity
            ),
            &["noise", "stall s", "commit s", "commit/quiet", "noise rate"],
        );
        for x in &i.rows {
            t.rows.push(vec![
                x.noise.clone(),
                secs(&x.stall_s),
                secs(&x.commit_s),
                format!("{:.2}", x.commit_vs_quiet),
                format!("{:.3e}", x.noise_rate),
            ]);
        }
        t.rows.push(vec![
            "compute-bound loop slowed by checkpointing".into(),
            String::new(),
            format!(
                "{:.3} vs {:.3}",
                i.compute_loop_ckpt_s.median, i.compute_loop_s.median
            ),
            format!("{:+.1}%", i.compute_slowdown_pct),
            String::new(),
        ]);
        out.push(t);
    }
    if let Some(e) = &r.engine {
        out.push(engine_table(e));
    }
    if let Some(iv) = &r.interval {
        let mut t = Table::new(
            "interval",
            format!("Checkpoint interval for MTBF {:.0} s (cost = stall per save; restart = fixed + load time)", iv.mtbf_s),
            &["setup", "cost s", "restart s", "Young s", "Daly s", "goodput at Daly"],
        );
        for x in &iv.rows {
            t.rows.push(vec![
                x.plan.setup.clone(),
                format!("{:.4}", x.plan.cost_s),
                format!("{:.3}", x.restart_s),
                format!("{:.1}", x.plan.young_s),
                format!("{:.1}", x.plan.daly_s),
                format!("{:.5}", x.plan.goodput),
            ]);
        }
        out.push(t);
    }
    if let Some(sc) = &r.scale {
        let mut t = Table::new(
            "scale",
            format!(
                "Scale: {} MiB of data-parallel state held by every rank, fsynced; slowest rank per save, median [min-max] of {} saves; this machine has {} cores and one disk (ranks beyond that share them)",
                mib(sc.state_bytes as f64),
                sc.rows.first().map_or(0, |x| x.commit_s.n),
                sc.cores
            ),
            &["ranks", "dedup", "stall s", "commit s", "written MiB", "aggregate GB/s", "min rank GB/s"],
        );
        for x in &sc.rows {
            t.rows.push(vec![
                x.ranks.to_string(),
                if x.dedup { "yes" } else { "no" }.into(),
                secs(&x.stall_s),
                secs(&x.commit_s),
                mib(x.written_bytes as f64),
                format!("{:.2}", x.aggregate_gbps),
                format!("{:.3}", x.min_rank_gbps),
            ]);
        }
        out.push(t);
    }
    if let Some(s3) = &r.s3 {
        out.extend(s3_tables(s3));
    }
    if let Some(sh) = &r.sharded {
        out.extend(sharded_tables(sh));
    }
    if let Some(py) = &r.python {
        out.extend(python_tables(py));
    }
    out
}

/// An experiment's targets: each measured ratio against its bound, met or not.
fn targets_table(name: &str, title: &str, targets: &[Target]) -> Table {
    let mut g = Table::new(name, title.into(), &["target", "ratio", "bound", "met"]);
    for x in targets {
        g.rows.push(vec![
            x.what.clone(),
            format!("{:.3}", x.ratio),
            format!("{:.2}", x.bound),
            if x.met { "met" } else { "not met" }.into(),
        ]);
    }
    g
}

fn opt_secs(s: Option<&Summary>) -> String {
    s.map_or_else(String::new, secs)
}

/// `median [min-max]` of seconds, in milliseconds: stalls of a few ms would
/// all read 0.002 in seconds.
fn opt_ms(s: Option<&Summary>) -> String {
    s.map_or_else(String::new, |s| {
        format!(
            "{:.2} [{:.2}-{:.2}]",
            s.median * 1e3,
            s.min * 1e3,
            s.max * 1e3
        )
    })
}

/// The S3 experiment: ckpt beside the plain transfers, then its targets.
pub fn s3_tables(s: &S3Results) -> Vec<Table> {
    let mut t = Table::new(
        "s3",
        format!(
            "S3 ({}): {} MiB in {} tensors; median [min-max] of {} runs; baseline = one object by object_store, {} parts of 16 MiB in flight up, {} ranged GETs in flight down; ckpt = until committed, and load_latest with a fresh checkpointer",
            s.endpoint,
            mib(s.state_bytes as f64),
            s.tensors,
            s.rows.first().map_or(0, |x| x.save_s.n),
            s.write_concurrency,
            s.read_concurrency
        ),
        &["method", "save s", "load s", "save GB/s", "load GB/s", "objects/save"],
    );
    for x in &s.rows {
        t.rows.push(vec![
            x.name.clone(),
            secs(&x.save_s),
            secs(&x.load_s),
            format!("{:.2}", x.save_gbps),
            format!("{:.2}", x.load_gbps),
            x.objects.to_string(),
        ]);
    }
    let g = targets_table(
        "s3_targets",
        "S3: targets, ratios of medians in the same run (reported, not asserted)",
        &s.targets,
    );
    vec![t, g]
}

/// The Python experiment: saves and loads per method, its floors, the
/// training loops, its targets.
pub fn python_tables(py: &PyTrainResults) -> Vec<Table> {
    let mut t = Table::new(
        "python_methods",
        format!(
            "Python: {} ({} layers, width {}, vocabulary {}, {:.1}M parameters) plus AdamW, {} MiB of state in {} tensors, one process on CPU (torch {}); median [min-max] of {} saves after a training step each (every tensor changes), after a cold and a warm save (sampled for memory; the timed ones are not); stall = the call blocks the training loop, snapshot = until the state may change, durable = on disk with fsync; load (one method per file format) into the live model and optimizer, page cache dropped, every tensor checked equal; peak extra = Pss over the value before (staging kept between saves counts); ratios to the same run's floors",
            py.model,
            py.layers,
            py.width,
            py.vocab,
            py.params as f64 / 1e6,
            mib(py.state_bytes as f64),
            py.tensors,
            py.torch,
            py.repeats
        ),
        &[
            "method", "stall ms", "snapshot s", "durable s", "load s", "written MiB",
            "peak extra save MiB", "peak extra load MiB", "stall/memcpy", "durable/write", "load/read",
        ],
    );
    for x in &py.methods {
        if let Some(why) = &x.skipped {
            let mut row = vec![x.name.clone(), format!("skipped: {why}")];
            row.resize(11, String::new());
            t.rows.push(row);
            continue;
        }
        let opt_ratio = |r: f64| {
            if r.is_nan() {
                String::new()
            } else {
                format!("{r:.2}")
            }
        };
        t.rows.push(vec![
            x.name.clone(),
            opt_ms(x.stall_s.as_ref()),
            opt_secs(x.snapshot_s.as_ref()),
            opt_secs(x.durable_s.as_ref()),
            opt_secs(x.load_s.as_ref()),
            mib(x.written_bytes as f64),
            mib(x.peak_save_extra_bytes as f64),
            x.peak_load_extra_bytes
                .map_or_else(String::new, |b| mib(b as f64)),
            opt_ratio(x.stall_vs_memcpy),
            opt_ratio(x.durable_vs_write),
            opt_ratio(x.load_vs_read),
        ]);
    }
    let fl = &py.floors;
    let mut f = Table::new(
        "python_floors",
        format!(
            "Python: the floors for the same {} MiB, fastest of their repeats at the start and the end of the run",
            mib(py.state_bytes as f64)
        ),
        &["floor", "seconds", "GB/s"],
    );
    let read = format!("sequential read, page cache: {}", fl.cache_drop);
    for (name, s) in [
        (
            "memcpy into preallocated buffers (torch copy_)",
            fl.memcpy_s,
        ),
        ("sequential write + fsync", fl.write_fsync_s),
        (read.as_str(), fl.read_cold_s),
    ] {
        f.rows.push(vec![
            name.into(),
            format!("{s:.4}"),
            format!("{:.2}", Limits::gbps(py.state_bytes, s)),
        ]);
    }
    let mut l = Table::new(
        "python_loop",
        format!(
            "Python: the training loop, {} rounds per method of {} real steps (forward, backward, AdamW; {} torch threads on {} cores, background work included) without checkpointing, then a save and steps until at least {} are done and it is durable; step = one step without checkpointing, its spread across the rounds showing the machine's other load; lost = that part's time minus as many steps at the round's pace; slowdown = lost over {} steps, of a loop that checkpoints every {} steps; durable in the loop / idle = checkpointing slowed by training; median [min-max] over the rounds",
            py.rounds, py.every, py.threads, py.cores, py.every, py.every, py.every
        ),
        &[
            "method", "step s", "steps to durable", "stall s", "lost per checkpoint s",
            "slowdown %", "durable in loop s", "durable in loop / idle",
        ],
    );
    for x in &py.loops {
        l.rows.push(vec![
            x.name.clone(),
            secs(&x.step_s),
            format!("{:.0}", x.ckpt_steps.median),
            secs(&x.stall_s),
            secs(&x.lost_s),
            format!(
                "{:+.1} [{:+.1}-{:+.1}]",
                x.slowdown.median * 100.0,
                x.slowdown.min * 100.0,
                x.slowdown.max * 100.0
            ),
            secs(&x.durable_s),
            x.durable_vs_idle
                .map_or_else(String::new, |r| format!("{r:.2}")),
        ]);
    }
    let g = targets_table(
        "python_targets",
        "Python: targets of the issue, ratios of medians in the same run (reported, not asserted)",
        &py.targets,
    );
    vec![t, f, l, g]
}

/// The sharded experiment: per method and rank count, its floors, its targets.
pub fn sharded_tables(sh: &ShardedResults) -> Vec<Table> {
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
                let mut row = vec![
                    run.ranks.to_string(),
                    x.name.clone(),
                    format!("skipped: {why}"),
                ];
                row.resize(12, String::new());
                t.rows.push(row);
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
    let g = targets_table(
        "sharded_targets",
        "Sharded state: targets of the issue, ratios of medians in the same run (reported, not asserted)",
        &sh.targets,
    );
    vec![t, f, g]
}

/// The engine benchmark: its figures, then its targets (ratio against bound).
pub fn engine_table(e: &EngineResults) -> Table {
    let mut t = Table::new(
        "engine",
        format!(
            "Engine: {} MiB of F32 in {} tensors; median [min-max] of {} runs; targets of the engine issue",
            e.state_bytes >> 20,
            e.tensors,
            e.memcpy_s.n
        ),
        &["figure", "value", "bound", "met"],
    );
    let figures = [
        ("memcpy of the state (1 thread), s", &e.memcpy_s),
        ("raw write + fsync, s", &e.raw_write_fsync_s),
        ("eager save stall, cold pool, s", &e.eager_stall_cold_s),
        ("eager save stall, warm pool, s", &e.eager_stall_s),
        ("lazy save stall, s", &e.lazy_stall_s),
        ("lazy snapshot (background), s", &e.lazy_snapshot_s),
        ("save until committed, warm pool, s", &e.commit_s),
        ("save until committed, cold pool, s", &e.commit_cold_s),
    ];
    for (name, s) in figures {
        t.rows
            .push(vec![name.into(), secs(s), String::new(), String::new()]);
    }
    t.rows.push(vec![
        "peak extra memory (cold save), MiB".into(),
        mib(e.peak_extra_bytes.median),
        String::new(),
        String::new(),
    ]);
    t.rows.push(vec![
        "stored by a 10%-changed checkpoint, MiB".into(),
        format!(
            "{} of {}",
            mib(e.incremental_stored_bytes as f64),
            mib(e.first_stored_bytes as f64)
        ),
        String::new(),
        String::new(),
    ]);
    for x in &e.targets {
        t.rows.push(vec![
            format!("target: {}", x.what),
            format!("{:.3}", x.ratio),
            format!("{:.2}", x.bound),
            if x.met { "yes" } else { "NO" }.into(),
        ]);
    }
    t
}

fn bar(label: &str, s: &Summary, group: usize) -> Bar {
    Bar {
        label: label.into(),
        value: s.median,
        lo: s.min,
        hi: s.max,
        group,
    }
}

/// Every plot of the results, by file stem.
pub fn charts(r: &SuiteResults) -> Vec<(String, Chart)> {
    let mut out = Vec::new();
    if let Some(f) = &r.formats {
        let g = |by: &str| usize::from(by != "ckpt");
        let floor = r
            .limits
            .as_ref()
            .map(|l| ("write+fsync floor".to_string(), l.write_fsync_s.median));
        out.push((
            "formats_save".into(),
            Chart::Bars {
                title: "Save until durable, by format".into(),
                unit: "seconds (median, min-max)".into(),
                bars: f
                    .rows
                    .iter()
                    .map(|x| bar(&x.name, &x.save_s, g(&x.by)))
                    .collect(),
                reference: floor,
            },
        ));
        out.push((
            "formats_stall".into(),
            Chart::Bars {
                title: "Stall (caller blocked), by format".into(),
                unit: "seconds".into(),
                bars: f
                    .rows
                    .iter()
                    .map(|x| bar(&x.name, &x.stall_s, g(&x.by)))
                    .collect(),
                reference: r
                    .limits
                    .as_ref()
                    .map(|l| ("memcpy floor".to_string(), l.memcpy_s.median)),
            },
        ));
        out.push((
            "formats_load".into(),
            Chart::Bars {
                title: "Load (page cache dropped), by format".into(),
                unit: "seconds".into(),
                bars: f
                    .rows
                    .iter()
                    .map(|x| bar(&x.name, &x.load_s, g(&x.by)))
                    .collect(),
                reference: r
                    .limits
                    .as_ref()
                    .map(|l| ("cold read floor".to_string(), l.read_cold_s.median)),
            },
        ));
        out.push((
            "formats_size".into(),
            Chart::Bars {
                title: "Size on disk by format and compression".into(),
                unit: "MiB".into(),
                bars: f
                    .rows
                    .iter()
                    .map(|x| {
                        let v = x.bytes as f64 / (1u64 << 20) as f64;
                        Bar {
                            label: x.name.clone(),
                            value: v,
                            lo: v,
                            hi: v,
                            group: g(&x.by),
                        }
                    })
                    .collect(),
                reference: Some(("raw".into(), f.state_bytes as f64 / (1u64 << 20) as f64)),
            },
        ));
    }
    if let Some(o) = &r.overhead {
        out.push((
            "overhead_stall".into(),
            Chart::Bars {
                title: "Training stall per checkpoint".into(),
                unit: "seconds".into(),
                bars: o
                    .rows
                    .iter()
                    .skip(1)
                    .map(|x| {
                        bar(
                            &x.name,
                            &x.stall_s,
                            usize::from(!x.name.starts_with("ckpt")),
                        )
                    })
                    .collect(),
                reference: None,
            },
        ));
    }
    if let Some(i) = &r.interference {
        out.push((
            "interference".into(),
            Chart::Bars {
                title: "Save until committed under noise".into(),
                unit: "seconds".into(),
                bars: i
                    .rows
                    .iter()
                    .enumerate()
                    .map(|(k, x)| bar(&x.noise, &x.commit_s, usize::from(k > 0)))
                    .collect(),
                reference: None,
            },
        ));
    }
    if let Some(iv) = &r.interval {
        out.push((
            "interval_goodput".into(),
            Chart::Lines {
                title: format!(
                    "Expected goodput by checkpoint interval (MTBF {:.0} s)",
                    iv.mtbf_s
                ),
                x_label: "interval between checkpoints (s)".into(),
                y_label: "goodput".into(),
                log_x: true,
                series: iv
                    .rows
                    .iter()
                    .map(|x| (x.plan.setup.clone(), x.curve.clone()))
                    .collect(),
            },
        ));
    }
    if let Some(sc) = &r.scale {
        let series = |dedup: bool| -> Vec<(f64, f64)> {
            sc.rows
                .iter()
                .filter(|x| x.dedup == dedup)
                .map(|x| (x.ranks as f64, x.aggregate_gbps))
                .collect()
        };
        out.push((
            "scale_throughput".into(),
            Chart::Lines {
                title: "Checkpoint throughput by ranks (state / time to commit)".into(),
                x_label: "ranks".into(),
                y_label: "GB/s".into(),
                log_x: true,
                series: vec![
                    ("dedup".into(), series(true)),
                    ("no dedup".into(), series(false)),
                ],
            },
        ));
    }
    if let Some(sh) = &r.sharded {
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
    }
    if let Some(py) = &r.python {
        type Pick = fn(&PyMethodRow) -> Option<&Summary>;
        let fl = &py.floors;
        for (name, title, f, floor) in [
            (
                "python_methods_stall",
                "Python: stall (the save call blocks the training loop)",
                (|x| x.stall_s.as_ref()) as Pick,
                ("memcpy floor", fl.memcpy_s),
            ),
            (
                "python_methods_durable",
                "Python: save until durable",
                (|x| x.durable_s.as_ref()) as Pick,
                ("write+fsync floor", fl.write_fsync_s),
            ),
            (
                "python_methods_load",
                "Python: load into the live model and optimizer (page cache dropped)",
                (|x| x.load_s.as_ref()) as Pick,
                ("cold read floor", fl.read_cold_s),
            ),
        ] {
            out.push((
                name.into(),
                Chart::Bars {
                    title: title.into(),
                    unit: "seconds (median, min-max)".into(),
                    bars: py
                        .methods
                        .iter()
                        .filter_map(|x| {
                            f(x).map(|s| bar(&x.name, s, usize::from(!x.name.starts_with("ckpt"))))
                        })
                        .collect(),
                    reference: Some((floor.0.into(), floor.1)),
                },
            ));
        }
        out.push((
            "python_loop_slowdown".into(),
            Chart::Bars {
                title: format!(
                    "Python: training-loop slowdown, a checkpoint every {} steps",
                    py.every
                ),
                unit: "% (median, min-max over the rounds)".into(),
                bars: py
                    .loops
                    .iter()
                    .map(|x| Bar {
                        label: x.name.clone(),
                        value: x.slowdown.median * 100.0,
                        lo: x.slowdown.min * 100.0,
                        hi: x.slowdown.max * 100.0,
                        group: usize::from(!x.name.starts_with("ckpt")),
                    })
                    .collect(),
                reference: None,
            },
        ));
    }
    out
}

/// Write results.json, the CSVs, the plots and report.md into `dir`.
pub fn write_all(r: &SuiteResults, dir: &Path) -> std::io::Result<()> {
    std::fs::create_dir_all(dir)?;
    std::fs::write(dir.join("results.json"), serde_json::to_vec_pretty(r)?)?;
    let tables = tables(r);
    for t in &tables {
        std::fs::write(dir.join(format!("{}.csv", t.id)), t.to_csv())?;
    }
    let plots = dir.join("plots");
    let charts = charts(r);
    for (name, c) in &charts {
        c.save(&plots, name)?;
    }
    let summary = r.formats.as_ref().and_then(crate::html::summary_chart);
    if let Some(c) = &summary {
        c.save(&plots, "summary")?;
    }
    let mut intro = String::new();
    if let Some(cfg) = &r.config {
        intro = format!(
            "State: {} shapes, {:?}, optimizer state {}, {:.1} MiB in {} tensors; {} repeats per figure (median [min-max]).",
            cfg.model,
            cfg.mix,
            cfg.optimizer,
            r.state_bytes as f64 / (1u64 << 20) as f64,
            r.state_tensors,
            r.formats.as_ref().and_then(|f| f.rows.first()).map_or(0, |x| x.save_s.n)
        );
    }
    let mut md = String::from("# ckpt-eval report\n\n");
    if !intro.is_empty() {
        let _ = writeln!(md, "{intro}\n");
    }
    let _ = writeln!(
        md,
        "The same report with the plots inline: [report.html](report.html).\n"
    );
    if summary.is_some() {
        let _ = writeln!(md, "![summary](plots/summary.svg)\n");
    }
    let mut sections = Vec::new();
    for t in &tables {
        let _ = writeln!(md, "## {}\n\n{}", t.title, t.to_markdown());
        let mine: Vec<&(String, Chart)> = charts
            .iter()
            .filter(|(n, _)| n.starts_with(&t.id))
            .collect();
        for (name, _) in &mine {
            let _ = writeln!(md, "![{name}](plots/{name}.svg)\n");
        }
        sections.push(crate::html::Section {
            table: t,
            charts: mine.iter().map(|(_, c)| c).collect(),
        });
    }
    let mut notes = Vec::new();
    for (what, why) in &r.not_included {
        notes.push(format!("not included: {what}: {why}"));
        let _ = writeln!(md, "- not included: **{what}**: {why}");
    }
    for (what, why) in &r.errors {
        notes.push(format!("FAILED: {what}: {why}"));
        let _ = writeln!(md, "- FAILED: **{what}**: {why}");
    }
    if let Some(f) = r.formats.as_ref().and_then(|f| f.python_error.as_ref()) {
        notes.push(format!(
            "Python baselines of the formats experiment missing: {f}"
        ));
        let _ = writeln!(
            md,
            "- Python baselines of the formats experiment missing: {f}"
        );
    }
    let html = crate::html::page(&intro, summary.as_ref(), &sections, &notes);
    std::fs::write(dir.join("report.html"), html)?;
    std::fs::write(dir.join("report.md"), md)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_renderings() {
        let mut t = Table::new("x", "T".into(), &["a", "b"]);
        t.rows.push(vec!["p,q".into(), "say \"hi\"".into()]);
        assert_eq!(t.to_csv(), "a,b\n\"p,q\",\"say \"\"hi\"\"\"\n");
        assert_eq!(
            t.to_markdown(),
            "| a | b |\n| --- | --- |\n| p,q | say \"hi\" |\n"
        );
        let text = t.to_text();
        assert!(text.contains("p,q") && text.lines().count() == 5, "{text}");
    }
}
