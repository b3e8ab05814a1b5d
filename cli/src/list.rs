//! `ckpt list`: a table for people, JSON for scripts.

use ckpt_core::{CheckpointInfo, Status};

/// The status column: `verified` only when the data was read and checked.
fn status(r: &CheckpointInfo, verified: bool) -> String {
    match &r.status {
        Status::Committed if verified => "verified".to_owned(),
        Status::Committed => "committed".to_owned(),
        Status::Incomplete => "incomplete".to_owned(),
        Status::Corrupt(why) => format!("CORRUPT: {why}"),
        Status::Fenced => "fenced (a zombie writer's; never loaded)".to_owned(),
        Status::Unsupported(why) => format!("UNSUPPORTED here: {why}"),
        other => format!("{other:?}"),
    }
}

/// The rows as an aligned table, with a closing line that says what was checked.
pub fn table(rows: &[CheckpointInfo], verified: bool) -> String {
    let header = [
        "STEP", "ATTEMPT", "EPOCH", "SIZE", "TENSORS", "FORMAT", "STATUS",
    ];
    let cells: Vec<[String; 7]> = rows
        .iter()
        .map(|r| {
            [
                r.id.step.to_string(),
                r.id.attempt.clone(),
                r.epoch.map_or_else(|| "-".to_owned(), |e| e.to_string()),
                crate::human(r.bytes),
                if r.tensors == 0 {
                    "-".to_owned()
                } else {
                    r.tensors.to_string()
                },
                r.format.clone().unwrap_or_else(|| "-".into()),
                status(r, verified),
            ]
        })
        .collect();
    let mut width = header.map(str::len);
    for row in &cells {
        for (w, c) in width.iter_mut().zip(row) {
            *w = (*w).max(c.chars().count());
        }
    }
    // Numbers right-aligned, text left-aligned; the last column is not padded.
    let right = [true, false, true, true, true, false, false];
    let line = |row: &[String]| {
        let mut s = String::new();
        for (i, c) in row.iter().enumerate() {
            if i > 0 {
                s.push_str("  ");
            }
            if i == row.len() - 1 {
                s.push_str(c);
            } else if right[i] {
                s.push_str(&format!("{c:>w$}", w = width[i]));
            } else {
                s.push_str(&format!("{c:<w$}", w = width[i]));
            }
        }
        s.push('\n');
        s
    };
    let mut out = line(&header.map(String::from));
    for row in &cells {
        out.push_str(&line(row));
    }
    let committed = rows
        .iter()
        .filter(|r| r.status == Status::Committed)
        .count();
    let corrupt = rows
        .iter()
        .filter(|r| matches!(r.status, Status::Corrupt(_)))
        .count();
    out.push_str(&match (rows.is_empty(), verified) {
        (true, _) => "(no checkpoints)\n".to_owned(),
        (false, true) => format!("{committed} verified, {corrupt} corrupt\n"),
        (false, false) => format!(
            "{committed} committed, {corrupt} corrupt (data not read: --verify checks every tensor)\n"
        ),
    });
    out
}

/// The rows as a JSON array of objects.
pub fn json(rows: &[CheckpointInfo], verified: bool) -> String {
    let rows: Vec<serde_json::Value> = rows
        .iter()
        .map(|r| {
            let (state, error) = match &r.status {
                Status::Committed => ("committed", None),
                Status::Incomplete => ("incomplete", None),
                Status::Corrupt(why) => ("corrupt", Some(why.clone())),
                Status::Fenced => ("fenced", None),
                Status::Unsupported(why) => ("unsupported", Some(why.clone())),
                _ => ("unknown", None),
            };
            serde_json::json!({
                "step": r.id.step,
                "attempt": r.id.attempt,
                "epoch": r.epoch,
                "bytes": r.bytes,
                "tensors": r.tensors,
                "format": r.format,
                "status": state,
                "verified": verified && r.status == Status::Committed,
                "error": error,
            })
        })
        .collect();
    serde_json::Value::Array(rows).to_string()
}
