//! The experiments of `ckpt-eval`, one module each, and what they share.

pub mod determinism;
pub mod engine;
pub mod formats;
pub mod interference;
pub mod interval;
pub mod overhead;
pub mod pytrain;
pub mod s3;
pub mod scale;
pub mod sharded;

use std::path::PathBuf;

use indicatif::{ProgressBar, ProgressStyle};

/// What every experiment gets.
#[derive(Debug, Clone)]
pub struct Ctx {
    /// Directory on the disk under test (checkpoints are written and deleted here).
    pub scratch: PathBuf,
    /// Repeats of each measurement.
    pub repeats: usize,
    /// The Python interpreter for the baselines (`None`: baselines are left out).
    pub python: Option<PathBuf>,
    /// Show progress bars (on a terminal).
    pub progress: bool,
}

impl Ctx {
    /// A progress bar of `len` steps, hidden when progress is off or stderr is not
    /// a terminal.
    pub fn bar(&self, len: u64, what: &str) -> ProgressBar {
        if !self.progress {
            return ProgressBar::hidden();
        }
        let pb = ProgressBar::new(len);
        pb.set_style(
            ProgressStyle::with_template("{prefix:>14} [{bar:30}] {pos}/{len} {msg} ({elapsed})")
                .unwrap_or_else(|_| ProgressStyle::default_bar())
                .progress_chars("=> "),
        );
        pb.set_prefix(what.to_owned());
        pb
    }

    /// A fresh, empty directory under the scratch directory.
    pub fn fresh_dir(&self, name: &str) -> std::io::Result<PathBuf> {
        let d = self.scratch.join(name);
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d)?;
        Ok(d)
    }
}

/// `file://` URL of a local directory.
pub fn file_url(dir: &std::path::Path) -> String {
    format!("file://{}", dir.display())
}

/// Total bytes of the files under `dir`.
pub fn dir_bytes(dir: &std::path::Path) -> u64 {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return 0;
    };
    rd.flatten()
        .map(|e| {
            let p = e.path();
            if p.is_dir() {
                dir_bytes(&p)
            } else {
                e.metadata().map(|m| m.len()).unwrap_or(0)
            }
        })
        .sum()
}

/// Error type of the experiments.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;
