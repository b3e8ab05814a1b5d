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

/// What the Python benchmark scripts share (`benchlib.py`), written next to each.
pub const BENCHLIB: &str = include_str!("../../python/benchlib.py");

/// Write a Python benchmark script and the module it imports into `dir`;
/// returns the script's path.
pub(crate) fn write_bench_script(
    dir: &std::path::Path,
    name: &str,
    script: &str,
) -> std::io::Result<PathBuf> {
    std::fs::write(dir.join("benchlib.py"), BENCHLIB)?;
    let path = dir.join(name);
    std::fs::write(&path, script)?;
    Ok(path)
}

/// Why a Python-driven experiment cannot run: no interpreter, or `imports`
/// (a Python `import` statement's list) fail in it; `None` when it can.
pub(crate) fn python_missing(python: Option<&std::path::Path>, imports: &str) -> Option<String> {
    let Some(py) = python else {
        return Some("no Python interpreter (set CKPT_PYTHON or run scripts/setup.sh)".into());
    };
    let ok = std::process::Command::new(py)
        .args(["-c", &format!("import {imports}")])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status()
        .map(|s| s.success())
        .unwrap_or(false);
    (!ok).then(|| format!("{} cannot import {imports}", py.display()))
}

/// The median of `a` over `b` (NaN when `a` is missing).
pub(crate) fn ratio(a: Option<&crate::stats::Summary>, b: f64) -> f64 {
    a.map_or(f64::NAN, |s| s.median / b)
}

/// Error type of the experiments.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;
