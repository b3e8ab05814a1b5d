//! `report.html`: the report as one self-contained page, for a browser. Plots are
//! inline SVG, so their text is set in the viewer's own fonts; no file beside it
//! is needed (`report.md` links the same plots as `plots/*.svg`).

use std::fmt::Write as _;

use crate::plot::Chart;
use crate::table::Table;

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

const STYLE: &str = "body{font-family:system-ui,-apple-system,'Segoe UI',Roboto,sans-serif;\
max-width:1000px;margin:2em auto;padding:0 1em;color:#222;line-height:1.45}\
h1{font-size:1.7em}h2{font-size:1.25em;margin-top:2em;border-bottom:1px solid #ddd}\
table{border-collapse:collapse;font-size:.9em;margin:1em 0}\
th,td{padding:.25em .6em;border-bottom:1px solid #eee;text-align:left}\
td.n{text-align:right;font-variant-numeric:tabular-nums}th{background:#f6f6f6}\
figure{margin:1em 0}svg{max-width:100%;height:auto}.note{color:#555}.top{font-weight:600}";

/// One section of the page.
pub struct Section<'a> {
    /// Its table.
    pub table: &'a Table,
    /// Its plots.
    pub charts: Vec<&'a Chart>,
}

/// The whole page.
/// `top`: lines for the top of the page (what did not run, what failed).
pub fn page(
    intro: &str,
    top: &[String],
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
    if !top.is_empty() {
        s.push_str("<ul class=\"top\">\n");
        for n in top {
            let _ = writeln!(s, "<li>{}</li>", escape(n));
        }
        s.push_str("</ul>\n");
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
            &["not run: x: <why>".into()],
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
        assert!(html.contains("<li>not run: x: &lt;why&gt;</li>"));
    }
}
