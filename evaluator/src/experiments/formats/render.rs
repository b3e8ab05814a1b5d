//! The formats experiment's tables, charts and the report's summary figure.

use super::results::FormatResults;
use crate::limits::Limits;
use crate::plot::{bar, Bar, Chart};
use crate::table::{mib, opt_secs, secs, Table};

/// The formats table.
pub fn formats_table(f: &FormatResults) -> Table {
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
    t
}

/// The machine's floors for the shared state.
pub fn limits_table(l: &Limits) -> Table {
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
    t
}

/// Its plots: save, stall, load and size by format, against the floors.
pub fn charts(f: &FormatResults, l: &Limits) -> Vec<(String, Chart)> {
    let mut out = Vec::new();
    let g = |by: &str| usize::from(by != "ckpt");
    let floor = Some(("write+fsync floor".to_string(), l.write_fsync_s.median));
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
            reference: Some(("memcpy floor".to_string(), l.memcpy_s.median)),
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
            reference: Some(("cold read floor".to_string(), l.read_cold_s.median)),
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
    out
}

/// The summary figure: how long each peer takes relative to ckpt's first row
/// (`ckpt native`), on stall, time until durable and load. `None` without a ckpt
/// row and a peer.
pub fn summary_chart(f: &FormatResults) -> Option<Chart> {
    let ours = f.rows.iter().find(|r| r.by == "ckpt")?;
    let peers: Vec<_> = f.rows.iter().filter(|r| r.by != "ckpt").collect();
    if peers.is_empty() {
        return None;
    }
    let mut bars = Vec::new();
    for p in peers {
        let metrics = [
            ("stall", &p.stall_s, &ours.stall_s),
            ("durable", &p.save_s, &ours.save_s),
            ("load", &p.load_s, &ours.load_s),
        ];
        for (group, (what, theirs, mine)) in metrics.into_iter().enumerate() {
            if mine.median <= 0.0 || !theirs.median.is_finite() {
                continue;
            }
            // The spread of the ratio from the extremes of both sides.
            let lo = if mine.max > 0.0 {
                theirs.min / mine.max
            } else {
                0.0
            };
            let hi = if mine.min > 0.0 {
                theirs.max / mine.min
            } else {
                theirs.median / mine.median
            };
            bars.push(Bar {
                label: format!("{}: {what}", p.name),
                value: theirs.median / mine.median,
                lo,
                hi,
                group,
            });
        }
    }
    Some(Chart::Bars {
        title: format!(
            "Each peer's time relative to {} (stall, until durable, load)",
            ours.name
        ),
        unit: format!(
            "times {} (median, min-max; above 1: ckpt is faster)",
            ours.name
        ),
        bars,
        reference: Some((ours.name.clone(), 1.0)),
    })
}

#[cfg(test)]
mod tests {
    use super::super::results::FormatRow;
    use super::*;
    use crate::stats::Summary;

    fn s(v: f64) -> Summary {
        Summary::of(&[v * 0.9, v, v * 1.1])
    }

    fn row(name: &str, by: &str, t: f64) -> FormatRow {
        FormatRow {
            name: name.into(),
            by: by.into(),
            save_s: s(t),
            stall_s: s(t / 2.0),
            load_s: s(t / 4.0),
            load_into_s: None,
            bytes: 1,
            save_gbps: 1.0,
            load_gbps: 1.0,
            save_vs_floor: 1.0,
            load_vs_floor: 1.0,
            load_into_vs_floor: None,
        }
    }

    #[test]
    fn summary_is_each_peer_over_ckpt_on_three_measures() {
        let f = FormatResults {
            state_bytes: 1,
            tensors: 1,
            rows: vec![
                row("ckpt native", "ckpt", 1.0),
                row("torch.save", "python", 3.0),
            ],
            python_error: None,
            targets: Vec::new(),
        };
        let Some(Chart::Bars {
            bars, reference, ..
        }) = summary_chart(&f)
        else {
            panic!("no summary")
        };
        let labels: Vec<_> = bars.iter().map(|b| b.label.as_str()).collect();
        assert_eq!(
            labels,
            [
                "torch.save: stall",
                "torch.save: durable",
                "torch.save: load"
            ]
        );
        assert!(bars
            .iter()
            .all(|b| (b.value - 3.0).abs() < 1e-9 && b.lo < 3.0 && b.hi > 3.0));
        assert_eq!(reference, Some(("ckpt native".to_string(), 1.0)));
    }
}
