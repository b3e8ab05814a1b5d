//! `report.html`: the report as one self-contained page, for a browser. Plots are
//! inline SVG, so their text is set in the viewer's own fonts; no file beside it
//! is needed (`report.md` links the same plots as `plots/*.svg`).

use std::fmt::Write as _;

use crate::experiments::formats::FormatResults;
use crate::plot::{Bar, Chart};
use crate::report::Table;

/// Escape text for HTML.
pub fn escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

/// A table as HTML; numbers (cells starting with a digit) right-aligned.
pub fn table(t: &Table) -> String {
    let mut s = String::from("<table>\n<thead><tr>");
    for h in &t.header {
        let _ = write!(s, "<th>{}</th>", escape(h));
    }
    s.push_str("</tr></thead>\n<tbody>\n");
    for row in &t.rows {
        s.push_str("<tr>");
        for c in row {
            let num = c.starts_with(|ch: char| ch.is_ascii_digit());
            let _ = write!(
                s,
                "<td{}>{}</td>",
                if num { " class=\"n\"" } else { "" },
                escape(c)
            );
        }
        s.push_str("</tr>\n");
    }
    s.push_str("</tbody>\n</table>\n");
    s
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

const STYLE: &str = "body{font-family:system-ui,-apple-system,'Segoe UI',Roboto,sans-serif;\
max-width:1000px;margin:2em auto;padding:0 1em;color:#222;line-height:1.45}\
h1{font-size:1.7em}h2{font-size:1.25em;margin-top:2em;border-bottom:1px solid #ddd}\
table{border-collapse:collapse;font-size:.9em;margin:1em 0}\
th,td{padding:.25em .6em;border-bottom:1px solid #eee;text-align:left}\
td.n{text-align:right;font-variant-numeric:tabular-nums}th{background:#f6f6f6}\
figure{margin:1em 0}svg{max-width:100%;height:auto}.note{color:#555}";

/// One section of the page.
pub struct Section<'a> {
    /// Its table.
    pub table: &'a Table,
    /// Its plots.
    pub charts: Vec<&'a Chart>,
}

/// The whole page.
pub fn page(
    intro: &str,
    summary: Option<&Chart>,
    sections: &[Section<'_>],
    notes: &[String],
) -> String {
    let mut s = format!(
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">\
<title>ckpt-eval report</title><style>{STYLE}</style></head><body>\n<h1>ckpt-eval report</h1>\n"
    );
    if !intro.is_empty() {
        let _ = writeln!(s, "<p>{}</p>", escape(intro));
    }
    if let Some(c) = summary {
        let _ = writeln!(s, "<figure>{}</figure>", c.to_svg());
    }
    for sec in sections {
        let _ = writeln!(
            s,
            "<h2>{}</h2>\n{}",
            escape(&sec.table.title),
            table(sec.table)
        );
        for c in &sec.charts {
            let _ = writeln!(s, "<figure>{}</figure>", c.to_svg());
        }
    }
    if !notes.is_empty() {
        s.push_str("<ul class=\"note\">\n");
        for n in notes {
            let _ = writeln!(s, "<li>{}</li>", escape(n));
        }
        s.push_str("</ul>\n");
    }
    s.push_str("</body></html>\n");
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::experiments::formats::FormatRow;
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

    #[test]
    fn page_is_self_contained_and_escaped() {
        let t = Table {
            id: "x".into(),
            title: "A <b> & c".into(),
            header: vec!["name".into(), "s".into()],
            rows: vec![vec!["<script>".into(), "1.5".into()]],
        };
        let c = Chart::Bars {
            title: "t".into(),
            unit: "s".into(),
            bars: vec![],
            reference: None,
        };
        let html = page(
            "intro",
            Some(&c),
            &[Section {
                table: &t,
                charts: vec![&c],
            }],
            &["n".into()],
        );
        assert!(html.starts_with("<!DOCTYPE html>") && html.trim_end().ends_with("</html>"));
        assert!(html.contains("A &lt;b&gt; &amp; c") && html.contains("&lt;script&gt;"));
        assert!(!html.contains("<script>") && !html.contains("src=") && !html.contains("href="));
        assert_eq!(html.matches("<svg").count(), 2);
        assert!(html.contains("<td class=\"n\">1.5</td>"));
    }
}
