//! The JSON-line reports test jobs print for the process that started them: one
//! typed message per line, written with `serde_json` on one side and read back
//! into the same type on the other.

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

/// What one rank of `mpi_ckpt` (the MPI test job of `ckpt-tests`) reports, one
/// line per rank on stdout. Its tests and the fault campaign read these lines.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "event", rename_all = "snake_case")]
pub enum RankReport {
    /// `save`: this rank's share is written and the checkpoint committed.
    Saved {
        /// This rank.
        rank: usize,
        /// Ranks in the job.
        world: usize,
        /// Tensor bytes this rank wrote.
        raw_bytes: u64,
        /// Bytes it stored (after compression, without deduplicated chunks).
        stored_bytes: u64,
        /// The committed checkpoint (`step-attempt`).
        committed: String,
    },
    /// `save`: the save failed on this rank.
    SaveFailed {
        /// This rank.
        rank: usize,
        /// The error's variant: `storage`, `timeout`, `stragglers`, `internal` or `other`.
        error: String,
        /// The OS error number under it, if there is one.
        errno: Option<i32>,
    },
    /// `load`: this rank loaded its share of `loaded_step` and verified every
    /// byte of it.
    Loaded {
        /// This rank.
        rank: usize,
        /// Ranks in the job.
        world: usize,
        /// The step it loaded.
        loaded_step: u64,
        /// Ranks of the job that saved it.
        saved_world: usize,
    },
}

impl RankReport {
    /// The step it loaded, for a [`RankReport::Loaded`].
    pub fn loaded_step(&self) -> Option<u64> {
        match self {
            RankReport::Loaded { loaded_step, .. } => Some(*loaded_step),
            _ => None,
        }
    }
}

/// Print one report as a line of JSON on stdout.
pub fn print_line<T: Serialize>(report: &T) {
    match serde_json::to_string(report) {
        Ok(line) => println!("{line}"),
        Err(e) => eprintln!("report not serializable: {e}"),
    }
}

/// Read the reports in `text`, one JSON object a line. Lines that do not start
/// with `{` are not reports (a launcher such as `mpirun` may write its own
/// lines to the same stream) and are skipped; a line that starts with `{` but is
/// not a `T` is an error that quotes the line.
pub fn parse_lines<T: DeserializeOwned>(text: &str) -> Result<Vec<T>, String> {
    text.lines()
        .enumerate()
        .filter(|(_, l)| l.trim_start().starts_with('{'))
        .map(|(i, l)| {
            serde_json::from_str(l).map_err(|e| format!("report line {}: {e}: {l}", i + 1))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rank_reports_round_trip_and_bad_lines_are_named() {
        let r = RankReport::SaveFailed {
            rank: 2,
            error: "storage".into(),
            errno: Some(28),
        };
        let text = format!(
            "mpirun: a line of its own\n{}\n",
            serde_json::to_string(&r).unwrap()
        );
        assert_eq!(parse_lines::<RankReport>(&text).unwrap(), vec![r]);
        let err = parse_lines::<RankReport>("{\"event\":\"saved\",\"rank\":1}").unwrap_err();
        assert!(
            err.contains("report line 1") && err.contains("\"rank\":1"),
            "{err}"
        );
    }
}
