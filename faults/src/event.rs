//! What the victim (`fault_victim`) tells the runner: one [`Event`] a line, as
//! JSON, appended and fsynced to its report file, so that the lines of a start
//! that was killed are still there. The victim writes them with [`Event::append`]
//! and the runner reads them back with [`read_from`].

use std::io::{Read, Seek, SeekFrom, Write};
use std::path::Path;

use ckpt_core::store::FaultCounts;
use serde::{Deserialize, Serialize};

use super::record::Skipped;

/// An error as the victim reports it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Failure {
    /// Error class (`corrupt`, `not_found`, `storage`, `timeout`, ...).
    pub kind: String,
    /// The error.
    pub error: String,
}

/// One line of the victim's report.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "event", rename_all = "snake_case")]
pub enum Event {
    /// Where the job resumed, after `load_latest`.
    Start {
        /// The victim's pid.
        pid: u32,
        /// `load_latest`, ms.
        load_ms: f64,
        /// From the start of the process, ms.
        since_exec_ms: f64,
        /// The step it resumed from (`None`: a fresh start).
        resumed_from: Option<u64>,
        /// The attempt of that checkpoint.
        attempt: Option<String>,
        /// The committed checkpoints it skipped as damaged, newest first.
        skipped: Vec<Skipped>,
    },
    /// The first step of this start is done.
    FirstStep {
        /// Its step.
        step: u64,
        /// From the start of the process, ms.
        since_exec_ms: f64,
        /// Faults the store injected so far.
        faults: FaultCounts,
    },
    /// A save ended.
    Save {
        /// Its step.
        step: u64,
        /// Why it failed (`None`: committed).
        failed: Option<Failure>,
        /// Faults the store injected so far.
        faults: FaultCounts,
    },
    /// Training is done and the final weights are written.
    Done {
        /// The last step.
        step: u64,
        /// Faults the store injected in this start.
        faults: FaultCounts,
    },
    /// The job stopped with an error.
    Error(Failure),
    /// `--torch-baseline save`: the state at `step` is written with libtorch's
    /// own serializer (`Tensor::save_multi`) and fsynced.
    TorchSave {
        /// The step of the state.
        step: u64,
        /// Tensors written.
        tensors: usize,
        /// Bytes of the file.
        bytes: u64,
        /// `save_multi` and the fsyncs, ms.
        save_ms: f64,
    },
    /// `--torch-baseline restore`: the file is read (`Tensor::load_multi`) and its
    /// state copied into the model and the optimizer.
    TorchLoad {
        /// The victim's pid.
        pid: u32,
        /// The step it resumed from.
        step: u64,
        /// `load_multi`, ms (the copy into place not included, as `load_ms` of
        /// [`Event::Start`] leaves out ckpt's).
        load_ms: f64,
        /// From the start of the process, ms.
        since_exec_ms: f64,
    },
}

impl Event {
    /// The fault counts it carries, if it carries any.
    pub fn faults(&self) -> Option<&FaultCounts> {
        match self {
            Event::FirstStep { faults, .. }
            | Event::Save { faults, .. }
            | Event::Done { faults, .. } => Some(faults),
            Event::Start { .. }
            | Event::Error(_)
            | Event::TorchSave { .. }
            | Event::TorchLoad { .. } => None,
        }
    }

    /// Append this event to `file` as a line and fsync it.
    pub fn append(&self, file: &mut std::fs::File) -> std::io::Result<()> {
        let line = serde_json::to_string(self).map_err(std::io::Error::other)?;
        writeln!(file, "{line}")?;
        file.sync_data()
    }
}

/// The events appended to `path` after its first `offset` bytes (none if it
/// does not exist); a line that is not an [`Event`] is an error that quotes it.
pub fn read_from(path: &Path, offset: u64) -> Result<Vec<Event>, crate::error::Error> {
    let mut s = String::new();
    if let Ok(mut f) = std::fs::File::open(path) {
        f.seek(SeekFrom::Start(offset))
            .and_then(|_| f.read_to_string(&mut s))
            .map_err(|e| format!("reading {}: {e}", path.display()))?;
    }
    s.lines()
        .filter(|l| !l.is_empty())
        .map(|l| {
            serde_json::from_str(l).map_err(|e| {
                crate::error::Error::from(format!(
                    "{}: not a victim event ({e}): {l}",
                    path.display()
                ))
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_round_trip_and_a_bad_line_is_named() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("report.jsonl");
        let events = vec![
            Event::Start {
                pid: 7,
                load_ms: 1.5,
                since_exec_ms: 20.0,
                resumed_from: Some(4),
                attempt: Some("a1".into()),
                skipped: vec![Skipped {
                    step: 8,
                    attempt: "b2".into(),
                    kind: "corrupt".into(),
                    error: "bad chunk".into(),
                }],
            },
            Event::Save {
                step: 8,
                failed: Some(Failure {
                    kind: "storage".into(),
                    error: "disk full".into(),
                }),
                faults: FaultCounts::default(),
            },
            Event::Error(Failure {
                kind: "io".into(),
                error: "gone".into(),
            }),
            Event::TorchSave {
                step: 24,
                tensors: 27,
                bytes: 150_000,
                save_ms: 3.5,
            },
            Event::TorchLoad {
                pid: 8,
                step: 24,
                load_ms: 1.25,
                since_exec_ms: 30.0,
            },
        ];
        let mut f = std::fs::File::create(&path).unwrap();
        for e in &events {
            e.append(&mut f).unwrap();
        }
        assert_eq!(read_from(&path, 0).unwrap(), events);
        let offset = std::fs::metadata(&path).unwrap().len();
        writeln!(f, "{{\"event\":\"start\"}}").unwrap();
        let err = read_from(&path, offset).unwrap_err();
        assert!(err.to_string().contains("{\"event\":\"start\"}"), "{err}");
        assert!(read_from(&dir.path().join("none"), 0).unwrap().is_empty());
    }
}
