//! The Python experiment's tables and charts.

use super::results::{PyMethodRow, PyTrainResults};
use crate::limits::Limits;
use crate::plot::{bar, Bar, Chart};
use crate::stats::Summary;
use crate::table::{mib, opt_ms, opt_ratio, opt_secs, secs, Table};

/// The Python experiment: saves and loads per method, its floors, the
/// training loops, its targets.
pub fn tables(py: &PyTrainResults) -> Vec<Table> {
    let mut t = Table::new(
        "python_methods",
        format!(
            "Python: {} ({} layers, width {}, vocabulary {}, {:.1}M parameters) plus AdamW, {} MiB of state in {} tensors, one process on CPU (torch {}); median [min-max] of {} saves after a training step each (every tensor changes), after a cold and a warm save (sampled for memory; the timed ones are not); stall = the call blocks the training loop, first stall = a job's first save right after its first step (a new saver, opened as a job starts: ckpt's load_latest finds nothing), snapshot = until the state may change, durable = on disk with fsync; load (one method per file format) into the live model and optimizer, page cache dropped, every tensor checked equal; peak extra = Pss over the value before (staging kept between saves counts); ratios to the same run's floors",
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
            "method", "stall ms", "first stall ms", "snapshot s", "durable s", "load s", "written MiB",
            "peak extra save MiB", "peak extra load MiB", "stall/memcpy", "durable/write", "load/read",
        ],
    );
    for x in &py.methods {
        if let Some(why) = &x.skipped {
            t.push_note_row(vec![x.name.clone()], format!("skipped: {why}"));
            continue;
        }
        t.rows.push(vec![
            x.name.clone(),
            opt_ms(x.stall_s.as_ref()),
            x.first_stall_s
                .map_or_else(String::new, |s| format!("{:.1}", s * 1e3)),
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
    vec![t, f, l]
}

/// Stall, durable and load by method against the floors; the loops' slowdown.
pub fn charts(py: &PyTrainResults) -> Vec<(String, Chart)> {
    let mut out = Vec::new();
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
    out
}
