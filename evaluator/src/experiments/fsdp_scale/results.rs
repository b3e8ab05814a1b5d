//! What the fsdp-scale experiment measured, and the slopes and targets made of it.

use serde::Serialize;

use crate::experiments::Target;
use crate::stats::Summary;

/// One rank count: the slowest rank's times, over the repetitions.
#[derive(Debug, Clone, Serialize)]
pub struct FsdpScaleRun {
    /// Number of ranks.
    pub ranks: usize,
    /// Tensors of model and optimizer state on a rank.
    pub tensors_per_rank: u64,
    /// Process group, model, FSDP2 and the first step, s.
    pub setup_s: f64,
    /// `Checkpointer(...)` on every rank (its coordinator's group included).
    pub ckpt_open_s: Summary,
    /// A root's first save, `save` + `wait`.
    pub ckpt_save_s: Summary,
    /// The next save after a training step, `save` + `wait`.
    pub ckpt_later_save_s: Summary,
    /// `load_latest` in place.
    pub ckpt_load_s: Summary,
    /// `get_state_dict` + `dcp.save`.
    pub dcp_save_s: Summary,
    /// `get_state_dict` + `dcp.load` + `set_state_dict`.
    pub dcp_load_s: Summary,
    /// Bytes of one checkpoint's manifest (the newest).
    pub manifest_bytes: u64,
    /// Bytes of every manifest of the root (two checkpoints).
    pub manifests_total_bytes: u64,
    /// Bytes of objects under `data/` named like metadata (none for the native format).
    pub data_metadata_bytes: u64,
    /// Bytes of DCP's `.metadata`.
    pub dcp_metadata_bytes: u64,
}

/// A quantity's growth with ranks: the least-squares slope of ln(value)
/// against ln(ranks), for ckpt and for DCP's counterpart.
#[derive(Debug, Clone, Serialize)]
pub struct Slope {
    /// What grows, e.g. `save`.
    pub what: String,
    /// ckpt's slope.
    pub ckpt: f64,
    /// DCP's slope.
    pub dcp: f64,
}

/// Results of the fsdp-scale experiment.
#[derive(Debug, Clone, Serialize)]
pub struct FsdpScaleResults {
    /// PyTorch's version.
    pub torch: String,
    /// FSDP2 blocks of the model.
    pub blocks: usize,
    /// Width of each block's Linear.
    pub width: usize,
    /// Repetitions per rank count.
    pub repeats: usize,
    /// One per rank count, in increasing order.
    pub runs: Vec<FsdpScaleRun>,
    /// Log-log slopes against ranks (empty with fewer than two rank counts).
    pub slopes: Vec<Slope>,
    /// The targets.
    pub targets: Vec<Target>,
    /// The rank count whose job failed or ran past its limit, and why (the
    /// larger ones were not run), if one did.
    pub failed: Option<String>,
}

/// Least-squares slope of ln(y) against ln(x); `None` without two distinct
/// x or with a value that is not positive.
pub fn log_log_slope(points: &[(f64, f64)]) -> Option<f64> {
    if points.iter().any(|&(x, y)| !(x > 0.0 && y > 0.0)) {
        return None;
    }
    let n = points.len() as f64;
    let (lx, ly): (Vec<f64>, Vec<f64>) = points.iter().map(|&(x, y)| (x.ln(), y.ln())).unzip();
    let (mx, my) = (lx.iter().sum::<f64>() / n, ly.iter().sum::<f64>() / n);
    let sxx: f64 = lx.iter().map(|x| (x - mx).powi(2)).sum();
    let sxy: f64 = lx.iter().zip(&ly).map(|(x, y)| (x - mx) * (y - my)).sum();
    (sxx > 1e-12).then(|| sxy / sxx)
}

type Pick = fn(&FsdpScaleRun) -> f64;

/// The quantities compared: name, ckpt's, DCP's.
const PAIRS: [(&str, Pick, Pick); 4] = [
    ("save", |r| r.ckpt_save_s.median, |r| r.dcp_save_s.median),
    (
        "later save (vs dcp.save)",
        |r| r.ckpt_later_save_s.median,
        |r| r.dcp_save_s.median,
    ),
    ("load", |r| r.ckpt_load_s.median, |r| r.dcp_load_s.median),
    (
        "metadata bytes",
        |r| r.manifest_bytes as f64,
        |r| r.dcp_metadata_bytes as f64,
    ),
];

/// Every quantity's slope for ckpt and DCP.
pub fn slopes(runs: &[FsdpScaleRun]) -> Vec<Slope> {
    let line =
        |f: Pick| -> Vec<(f64, f64)> { runs.iter().map(|r| (r.ranks as f64, f(r))).collect() };
    PAIRS
        .iter()
        .filter_map(|&(what, c, d)| {
            Some(Slope {
                what: what.into(),
                ckpt: log_log_slope(&line(c))?,
                dcp: log_log_slope(&line(d))?,
            })
        })
        .collect()
}

/// The targets: ckpt's save and load grow no faster with ranks than DCP's
/// (slopes), and take at most 0.3x DCP's at the largest rank count.
pub fn targets(runs: &[FsdpScaleRun], slopes: &[Slope]) -> Vec<Target> {
    let mut out = Vec::new();
    for s in slopes
        .iter()
        .filter(|s| s.what == "save" || s.what == "load")
    {
        out.push(Target::new(
            format!(
                "log-log slope of ckpt {} against ranks (bound: DCP's in the same run)",
                s.what
            ),
            s.ckpt,
            s.dcp,
        ));
    }
    if let Some(big) = runs.iter().max_by_key(|r| r.ranks) {
        for (what, c, d) in PAIRS.iter().filter(|p| p.0 == "save" || p.0 == "load") {
            out.push(Target::new(
                format!("{} ranks, ckpt {what} / dcp.{what}", big.ranks),
                c(big) / d(big),
                0.3,
            ));
        }
    }
    out
}
