//! Output of a run: the terminal's text, `results.json`, one CSV per table,
//! plots (SVG), `report.md` linking them and `report.html` with them inline
//! ([`crate::html`]), in one run directory. Both reports open with what did
//! not run and why, then the summary figure and every experiment's targets.
//! Everything here knows tables and charts, not experiments.

use std::fmt::Write as _;
use std::path::Path;

use crate::html::Section;
use crate::plot::Chart;
use crate::suite::SuiteResults;
use crate::table::{md_escape, Table};

/// The lines the top of a report gives: the state, what did not run and
/// what failed.
fn head(r: &SuiteResults) -> (String, Vec<String>) {
    let mut intro = String::new();
    if let (Some(spec), Some((bytes, tensors))) = (&r.state, r.state_made) {
        intro = format!(
            "State: {} shapes, {:?}, optimizer state {}, {:.1} MiB in {} tensors; {} repeats per figure (median [min-max]).",
            spec.model,
            spec.mix,
            spec.optimizer,
            bytes as f64 / (1u64 << 20) as f64,
            tensors,
            r.repeats
        );
    }
    let mut lines: Vec<String> = r
        .not_run()
        .map(|(what, why)| format!("not run: {what}: {why}"))
        .collect();
    lines.extend(
        r.errors()
            .map(|(what, why)| format!("FAILED: {what}: {why}")),
    );
    (intro, lines)
}

/// Every experiment's targets in one table (`None` when there are none).
pub fn targets_table(r: &SuiteResults) -> Option<Table> {
    let mut t = Table::new(
        "targets",
        "Targets: each measured value (ratios of medians in the same run, or a time) against its bound; reported, not asserted".into(),
        &["experiment", "target", "value", "bound", "met"],
    );
    for e in &r.experiments {
        for x in &e.output.targets {
            t.rows.push(vec![
                e.name.clone(),
                x.what.clone(),
                format!("{:.3}", x.ratio),
                format!("{:.2}", x.bound),
                if x.met { "met" } else { "NOT met" }.into(),
            ]);
        }
    }
    (!t.rows.is_empty()).then_some(t)
}

/// Every table: the targets first, then each experiment's in order.
pub fn tables(r: &SuiteResults) -> Vec<&Table> {
    r.experiments
        .iter()
        .flat_map(|e| e.output.tables.iter())
        .collect()
}

/// The run as text for the terminal: what did not run, every table, the targets.
pub fn to_text(r: &SuiteResults) -> String {
    let (_, lines) = head(r);
    let mut s = String::new();
    for l in &lines {
        let _ = writeln!(s, "{l}");
    }
    for t in tables(r) {
        s += &t.to_text();
    }
    if let Some(t) = targets_table(r) {
        s += &t.to_text();
    }
    for e in &r.experiments {
        for n in &e.output.notes {
            let _ = writeln!(s, "\n{n}");
        }
    }
    let took: Vec<String> = r
        .experiments
        .iter()
        .map(|e| format!("{} {:.0} s", e.name, e.secs))
        .collect();
    let _ = writeln!(s, "\ntime per experiment: {}", took.join(", "));
    s
}

/// Write results.json, the CSVs, the plots, report.md and report.html into `dir`.
pub fn write_all(r: &SuiteResults, dir: &Path) -> std::io::Result<()> {
    std::fs::create_dir_all(dir)?;
    std::fs::write(dir.join("results.json"), serde_json::to_vec_pretty(r)?)?;
    let targets = targets_table(r);
    let tables: Vec<&Table> = targets.iter().chain(tables(r)).collect();
    for t in &tables {
        std::fs::write(dir.join(format!("{}.csv", t.id)), t.to_csv())?;
    }
    let plots = dir.join("plots");
    let charts: Vec<&(String, Chart)> = r
        .experiments
        .iter()
        .flat_map(|e| e.output.charts.iter())
        .collect();
    for (name, c) in &charts {
        c.save(&plots, name)?;
    }
    let summary = r.experiments.iter().find_map(|e| e.output.summary.as_ref());
    if let Some(c) = summary {
        c.save(&plots, "summary")?;
    }
    let (intro, top) = head(r);
    let mut md = String::from("# ckpt-eval report\n\n");
    if !intro.is_empty() {
        let _ = writeln!(md, "{}\n", md_escape(&intro));
    }
    for l in &top {
        let _ = writeln!(md, "- **{}**", md_escape(l));
    }
    if !top.is_empty() {
        md.push('\n');
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
        let _ = writeln!(md, "## {}\n\n{}", md_escape(&t.title), t.to_markdown());
        let mine: Vec<&(String, Chart)> = charts
            .iter()
            .copied()
            .filter(|(n, _)| n.starts_with(&t.id))
            .collect();
        for (name, _) in &mine {
            let _ = writeln!(md, "![{name}](plots/{name}.svg)\n");
        }
        sections.push(Section {
            table: t,
            charts: mine.iter().map(|(_, c)| c).collect(),
        });
    }
    let mut notes: Vec<String> = r
        .experiments
        .iter()
        .flat_map(|e| e.output.notes.iter().cloned())
        .collect();
    notes.push(format!(
        "time per experiment: {}",
        r.experiments
            .iter()
            .map(|e| format!("{} {:.0} s", e.name, e.secs))
            .collect::<Vec<_>>()
            .join(", ")
    ));
    for n in &notes {
        let _ = writeln!(md, "- {}", md_escape(n));
    }
    let html = crate::html::page(&intro, &top, summary, &sections, &notes);
    std::fs::write(dir.join("report.html"), html)?;
    std::fs::write(dir.join("report.md"), md)
}
