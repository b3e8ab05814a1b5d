//! Tables, as experiments hand them to the report: plain text for the
//! terminal, Markdown (cells escaped), CSV (the `csv` crate), and the cell
//! formats the experiments share.

use crate::stats::Summary;

/// A table: a title, a header and rows of cells.
#[derive(Debug, Clone)]
pub struct Table {
    /// File stem of its CSV; charts whose stem starts with it go under it.
    pub id: String,
    /// Title.
    pub title: String,
    /// Column names.
    pub header: Vec<String>,
    /// Rows.
    pub rows: Vec<Vec<String>>,
}

impl Table {
    /// An empty table.
    pub fn new(id: &str, title: String, header: &[&str]) -> Table {
        Table {
            id: id.into(),
            title,
            header: header.iter().map(|s| s.to_string()).collect(),
            rows: vec![],
        }
    }

    /// A row whose first cells are `lead` and whose next cell says why the
    /// rest is empty (a method that did not run).
    pub fn push_note_row(&mut self, lead: Vec<String>, note: String) {
        let mut row = lead;
        row.push(note);
        row.resize(self.header.len().max(row.len()), String::new());
        self.rows.push(row);
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
                .take(n)
                .map(|(i, c)| {
                    let c = c.replace('\n', " ");
                    if i == 0 {
                        format!("{c:<width$}", width = w[i])
                    } else {
                        format!("{c:>width$}", width = w[i])
                    }
                })
                .collect::<Vec<_>>()
                .join("  ")
        };
        let rule: Vec<String> = w.iter().map(|&k| "-".repeat(k)).collect();
        let mut s = format!(
            "\n{}\n  {}\n  {}\n",
            self.title,
            line(&self.header),
            rule.join("  ")
        );
        for r in &self.rows {
            s += &format!("  {}\n", line(r));
        }
        s
    }

    /// A Markdown table, every cell escaped.
    pub fn to_markdown(&self) -> String {
        let row = |r: &[String]| {
            let cells: Vec<String> = r.iter().map(|c| md_escape(c)).collect();
            format!("| {} |\n", cells.join(" | "))
        };
        let mut s = row(&self.header);
        s += &format!("|{}\n", " --- |".repeat(self.header.len()));
        for r in &self.rows {
            s += &row(r);
        }
        s
    }

    /// CSV (RFC 4180, by the `csv` crate).
    pub fn to_csv(&self) -> String {
        let mut w = csv::WriterBuilder::new()
            .flexible(true)
            .from_writer(Vec::new());
        for r in std::iter::once(&self.header).chain(&self.rows) {
            // Writing into memory cannot fail.
            let _ = w.write_record(r);
        }
        String::from_utf8(w.into_inner().unwrap_or_default()).unwrap_or_default()
    }
}

/// Text for a Markdown table cell or heading: Markdown's punctuation is
/// backslash-escaped, and a line break (which would end the row) is a space.
pub fn md_escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for ch in s.chars() {
        match ch {
            '\\' | '|' | '*' | '_' | '`' | '[' | ']' | '<' | '>' | '#' => {
                out.push('\\');
                out.push(ch);
            }
            '\n' | '\r' => out.push(' '),
            _ => out.push(ch),
        }
    }
    out
}

/// `median [min-max]` of seconds.
pub fn secs(s: &Summary) -> String {
    format!("{:.3} [{:.3}-{:.3}]", s.median, s.min, s.max)
}

/// [`secs`] of a figure that may be missing (empty).
pub fn opt_secs(s: Option<&Summary>) -> String {
    s.map_or_else(String::new, secs)
}

/// `median [min-max]` of seconds, in milliseconds: stalls of a few ms would
/// all read 0.002 in seconds.
pub fn opt_ms(s: Option<&Summary>) -> String {
    s.map_or_else(String::new, |s| {
        format!(
            "{:.2} [{:.2}-{:.2}]",
            s.median * 1e3,
            s.min * 1e3,
            s.max * 1e3
        )
    })
}

/// Bytes in MiB, one decimal.
pub fn mib(b: f64) -> String {
    format!("{:.1}", b / (1u64 << 20) as f64)
}

/// A ratio with two decimals, empty when it is not a number.
pub fn opt_ratio(r: f64) -> String {
    if r.is_nan() {
        String::new()
    } else {
        format!("{r:.2}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renderings_quote_and_escape() {
        let mut t = Table::new("x", "T".into(), &["a", "b"]);
        t.rows.push(vec!["p,q".into(), "say \"hi\"".into()]);
        t.rows.push(vec!["a|b".into(), "x_y*\nz".into()]);
        assert_eq!(
            t.to_csv(),
            "a,b\n\"p,q\",\"say \"\"hi\"\"\"\na|b,\"x_y*\nz\"\n"
        );
        assert_eq!(
            t.to_markdown(),
            "| a | b |\n| --- | --- |\n| p,q | say \"hi\" |\n| a\\|b | x\\_y\\* z |\n"
        );
        let text = t.to_text();
        assert!(text.contains("p,q") && text.lines().count() == 6, "{text}");
    }

    #[test]
    fn note_rows_fill_the_header() {
        let mut t = Table::new("x", "T".into(), &["a", "b", "c", "d"]);
        t.push_note_row(vec!["m".into()], "skipped: no".into());
        assert_eq!(t.rows[0], ["m", "skipped: no", "", ""]);
    }
}
