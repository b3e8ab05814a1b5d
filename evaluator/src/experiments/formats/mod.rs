//! Formats: save time, load time, stored size and throughput of ckpt in each of
//! its formats (native with zstd levels, and every other registered format) and
//! of the Python baselines, on the same tensors in the same run.
//!
//! A ckpt save is timed from `save` until committed (durable); loads read a
//! checkpoint whose files' page cache was dropped (where the OS allows it) and are
//! checked equal to the saved state. The baselines do the same in Python.
//!
//! ckpt's loads are timed twice: `load_latest` (new buffers, what a restart
//! that builds its state from the checkpoint does) and `load_into` the caller's
//! own buffers (what a restart into a live model does), each with the page cache
//! dropped. The native format's targets (save and `load_into` against the
//! machine's floors) are reported, not asserted.

use std::time::Instant;

use ckpt_core::{Compression, State};

use super::{dir_bytes, file_url, Ctx, Error, Experiment, Output, Target};
use crate::limits::{drop_cache_tree, Limits};
use crate::python;
use crate::stats::Summary;

mod render;
mod results;
pub use render::{charts, formats_table, limits_table, summary_chart};
pub use results::{FormatResults, FormatRow};

/// Bound of the native format's time until durable over the write + fsync floor.
pub const NATIVE_SAVE_BOUND: f64 = 1.2;
/// Bound of the native format's `load_into` time over the cold read floor.
pub const NATIVE_LOAD_INTO_BOUND: f64 = 1.25;

/// Settings of the formats experiment.
#[derive(Debug, Clone)]
pub struct FormatsBench {
    /// zstd levels for the native format (0 = no compression).
    pub zstd_levels: Vec<i32>,
}

/// The samples of one way to save: save, stall and load seconds.
struct Samples<'a> {
    save: &'a [f64],
    stall: &'a [f64],
    load: &'a [f64],
    load_into: &'a [f64],
}

fn row(name: &str, by: &str, t: Samples<'_>, bytes: u64, raw: u64, lim: &Limits) -> FormatRow {
    let (save, stall, load) = (t.save, t.stall, t.load);
    let (save_s, stall_s, load_s) = (Summary::of(save), Summary::of(stall), Summary::of(load));
    let load_into_s = (!t.load_into.is_empty()).then(|| Summary::of(t.load_into));
    FormatRow {
        load_into_vs_floor: load_into_s
            .as_ref()
            .map(|s| s.median / lim.read_cold_s.median),
        load_into_s,
        name: name.to_owned(),
        by: by.to_owned(),
        save_gbps: Limits::gbps(raw, save_s.median),
        load_gbps: Limits::gbps(raw, load_s.median),
        save_vs_floor: save_s.median / lim.write_fsync_s.median,
        load_vs_floor: load_s.median / lim.read_cold_s.median,
        save_s,
        stall_s,
        load_s,
        bytes,
    }
}

impl FormatsBench {
    /// The ckpt variants to run: (display name, format name, compression).
    pub fn variants(&self) -> Vec<(String, String, Compression)> {
        let mut v = Vec::new();
        for &l in &self.zstd_levels {
            if l == 0 {
                v.push((
                    "ckpt native".to_owned(),
                    "native".to_owned(),
                    Compression::None,
                ));
            } else {
                v.push((
                    format!("ckpt native zstd-{l}"),
                    "native".to_owned(),
                    Compression::Zstd(l),
                ));
            }
        }
        for name in ckpt_formats::registry().names() {
            if name != "native" {
                v.push((format!("ckpt {name}"), name.to_owned(), Compression::None));
            }
        }
        v
    }

    /// Run on `state`, against the floors in `lim`.
    pub async fn run(
        &self,
        ctx: &Ctx,
        state: &State,
        lim: &Limits,
    ) -> Result<FormatResults, Error> {
        let raw = state.nbytes();
        let variants = self.variants();
        let pb = ctx.bar((variants.len() * ctx.repeats + 1) as u64, "formats");
        let mut rows = Vec::new();
        for (display, fmt, comp) in variants {
            pb.set_message(display.clone());
            let (mut save, mut stall, mut load, mut load_into) = (vec![], vec![], vec![], vec![]);
            let mut bytes = 0;
            for rep in 0..ctx.repeats {
                let dir = ctx.fresh_dir(&format!("formats-{fmt}-{rep}"))?;
                let cp = ckpt_formats::builder(file_url(&dir))
                    .format(ckpt_formats::by_name(&fmt)?)
                    .compression(comp)
                    .build()
                    .await?;
                let t = Instant::now();
                let h = cp.save(1, state).await?;
                stall.push(t.elapsed().as_secs_f64());
                h.wait().await?;
                save.push(t.elapsed().as_secs_f64());
                bytes = dir_bytes(&dir);
                drop(cp);
                drop_cache_tree(&dir);
                let cp = ckpt_formats::builder(file_url(&dir)).build().await?;
                let t = Instant::now();
                let loaded = cp.load_latest().await?.ok_or("checkpoint not found")?;
                load.push(t.elapsed().as_secs_f64());
                if loaded.state.tensors != state.tensors {
                    return Err(
                        format!("{display}: loaded tensors differ from the saved ones").into(),
                    );
                }
                // Into buffers that exist before the load, as a live model's do.
                let mut bufs: Vec<Vec<u8>> = state
                    .tensors
                    .iter()
                    .map(|t| vec![0xA5; t.data.len()])
                    .collect();
                drop(loaded);
                let id = cp.committed().await?.pop().ok_or("checkpoint not found")?;
                drop(cp);
                drop_cache_tree(&dir);
                let cp = ckpt_formats::builder(file_url(&dir)).build().await?;
                let targets = state
                    .tensors
                    .iter()
                    .zip(bufs.iter_mut())
                    .map(|(t, b)| (t.name.as_str(), b.as_mut_slice()))
                    .collect();
                let t = Instant::now();
                cp.load_into(&id, targets).await?;
                load_into.push(t.elapsed().as_secs_f64());
                if state
                    .tensors
                    .iter()
                    .zip(&bufs)
                    .any(|(t, b)| t.data.as_ref() != b.as_slice())
                {
                    return Err(format!("{display}: load_into filled different bytes").into());
                }
                drop(bufs);
                let _ = std::fs::remove_dir_all(&dir);
                pb.inc(1);
            }
            let t = Samples {
                save: &save,
                stall: &stall,
                load: &load,
                load_into: &load_into,
            };
            rows.push(row(&display, "ckpt", t, bytes, raw, lim));
        }
        let mut python_error = None;
        pb.set_message("python baselines");
        match &ctx.python {
            None => python_error = Some("no Python interpreter (set CKPT_PYTHON)".to_owned()),
            Some(py) => {
                let dir = ctx.fresh_dir("formats-python")?;
                let out = python::export(state, &dir)
                    .map_err(|e| e.to_string())
                    .and_then(|e| {
                        python::run(
                            py,
                            &e,
                            "formats",
                            &["--repeats".into(), ctx.repeats.to_string()],
                        )
                    });
                match out {
                    Ok(v) => {
                        for b in v["baselines"].as_array().into_iter().flatten() {
                            let name = b["name"].as_str().unwrap_or("?");
                            let (s, st, l) = (
                                python::floats(b, "save_s"),
                                python::floats(b, "stall_s"),
                                python::floats(b, "load_s"),
                            );
                            if s.is_empty() || st.is_empty() || l.is_empty() {
                                return Err(format!("baseline {name}: no timings").into());
                            }
                            let bytes = b["bytes"].as_u64().unwrap_or(0);
                            let t = Samples {
                                save: &s,
                                stall: &st,
                                load: &l,
                                load_into: &[],
                            };
                            rows.push(row(name, "python", t, bytes, raw, lim));
                        }
                    }
                    Err(e) => python_error = Some(e),
                }
                let _ = std::fs::remove_dir_all(&dir);
            }
        }
        pb.finish_and_clear();
        Ok(FormatResults {
            state_bytes: raw,
            tensors: state.tensors.len(),
            targets: targets(&rows, state.tensors.len()),
            rows,
            python_error,
        })
    }
}

/// The native format (uncompressed) against the floors: time until durable
/// and `load_into`, ratios of medians in the same run.
pub fn targets(rows: &[FormatRow], tensors: usize) -> Vec<Target> {
    let Some(native) = rows.iter().find(|r| r.name == "ckpt native") else {
        return Vec::new();
    };
    let mut out = vec![Target::new(
        format!("native save until durable / write+fsync floor ({tensors} tensors)"),
        native.save_vs_floor,
        NATIVE_SAVE_BOUND,
    )];
    if let Some(r) = native.load_into_vs_floor {
        out.push(Target::new(
            format!("native load_into / cold read floor ({tensors} tensors)"),
            r,
            NATIVE_LOAD_INTO_BOUND,
        ));
    }
    out
}

/// Options of the formats experiment (on the shared state).
#[derive(clap::Args, Debug, Clone, Default)]
pub struct Formats {
    /// Formats: zstd levels of the native format (0 = uncompressed), comma separated [default: 0,1,3].
    #[arg(long, value_delimiter = ',')]
    pub zstd: Option<Vec<i32>>,
}

impl Formats {
    fn bench(&self) -> FormatsBench {
        FormatsBench {
            zstd_levels: self.zstd.clone().unwrap_or_else(|| vec![0, 1, 3]),
        }
    }

    /// Run it on the shared state (kept for the interval experiment).
    pub async fn results(&self, ctx: &Ctx) -> Result<FormatResults, Error> {
        if let Some(r) = ctx.kept::<FormatResults>() {
            return Ok(r);
        }
        let shared = ctx.state().await?;
        let r = self.bench().run(ctx, &shared.0, &shared.1).await?;
        ctx.keep(r.clone());
        Ok(r)
    }
}

#[async_trait::async_trait]
impl Experiment for Formats {
    fn name(&self) -> &'static str {
        "formats"
    }

    fn about(&self, ctx: &Ctx) -> String {
        format!(
            "ckpt's formats ({} ways) and the Python baselines on {} MiB shaped like {}",
            self.bench().variants().len(),
            ctx.spec.mib,
            ctx.spec.model
        )
    }

    fn estimate_s(&self, ctx: &Ctx) -> f64 {
        // Per repeat and GiB, on a busy 2-core machine: about 6 s per ckpt
        // variant, 60 s for the Python baselines (81 s for 3 of 256 MiB); and
        // the shared state and its floors.
        let gib = ctx.spec.mib as f64 / 1024.0;
        let python = if ctx.python.is_some() { 60.0 } else { 0.0 };
        10.0 + ctx.repeats as f64 * gib * (6.0 * self.bench().variants().len() as f64 + python)
    }

    async fn run(&self, ctx: &Ctx) -> Result<Output, Error> {
        let f = self.results(ctx).await?;
        let shared = ctx.state().await?;
        let l = &shared.1;
        let mut out = Output::of(&f);
        out.tables = vec![formats_table(&f), limits_table(l)];
        out.charts = charts(&f, l);
        out.targets = f.targets.clone();
        out.summary = summary_chart(&f);
        if let Some(e) = &f.python_error {
            out.notes.push(format!(
                "Python baselines of the formats experiment missing: {e}"
            ));
        }
        Ok(out)
    }
}
