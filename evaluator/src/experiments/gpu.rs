//! GPU: a model training on a CUDA device, checkpointed by ckpt and its peers
//! (`evaluator/python/gpu_bench.py`, run in place with the venv's Python): the
//! stall of the first and later saves, the loop's slowdown, time until
//! durable, warm and cold restores, pinned and host memory peaks, against the
//! device's floors (device-to-host and back, write + fsync, cold read).
//!
//! The script writes one JSON file ([`GpuResults`]); without a CUDA device it
//! says why it did not run (`skipped`), and the report lists the experiment at
//! its top as not run, with that reason.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::script::{python_missing, run_bounded, tail};
use super::{Ctx, Error, Experiment, Output, Target};
use crate::table::Table;

/// Options of the GPU experiment; the script chooses what is not given.
#[derive(clap::Args, Debug, Clone, Default)]
pub struct Gpu {
    /// GPU: transformer blocks of the model.
    #[arg(long)]
    pub gpu_layers: Option<usize>,
    /// GPU: embedding width of the model.
    #[arg(long)]
    pub gpu_width: Option<usize>,
    /// GPU: tokens per sequence.
    #[arg(long)]
    pub gpu_seq: Option<usize>,
    /// GPU: sequences per training step.
    #[arg(long)]
    pub gpu_batch: Option<usize>,
    /// GPU: training steps between checkpoints.
    #[arg(long)]
    pub gpu_every: Option<usize>,
    /// GPU: checkpoints per method.
    #[arg(long)]
    pub gpu_rounds: Option<usize>,
}

/// The device's floors for the state's bytes, s.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct GpuFloors {
    /// Device to host.
    pub d2h_s: f64,
    /// Host to device.
    pub h2d_s: f64,
    /// Write + fsync of the bytes.
    pub write_fsync_s: f64,
    /// Read of them back, page cache dropped.
    pub cold_read_s: f64,
}

/// One method's figures (`None`: not measured for it).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct GpuMethod {
    /// e.g. `ckpt lazy`.
    pub method: String,
    /// Stall of the first save, s.
    pub stall_first_s: Option<f64>,
    /// Stall of later saves, s.
    pub stall_later_s: Option<f64>,
    /// Time the next step waited for the snapshot, s.
    pub step_wait_s: Option<f64>,
    /// Slowdown of the training loop (fraction).
    pub slowdown: Option<f64>,
    /// Time until durable, s.
    pub durable_s: Option<f64>,
    /// Restore with the page cache warm, s.
    pub restore_warm_s: Option<f64>,
    /// Restore with the page cache dropped, s.
    pub restore_cold_s: Option<f64>,
    /// Peak pinned host memory, bytes.
    pub pinned_peak_bytes: Option<u64>,
    /// Peak host memory, bytes.
    pub host_peak_bytes: Option<u64>,
    /// Why it failed, if it did.
    pub error: Option<String>,
    /// ckpt's methods: where a later save's stall went, timed inside `save`.
    #[serde(default)]
    pub stall_phases: Option<GpuStallPhases>,
    /// Where the loop's slowdown went, step by step after a save.
    #[serde(default)]
    pub step_excess: Option<GpuStepExcess>,
    /// The loop's first step, with what it left in the background (ckpt
    /// readies its first save there after a fresh start), s.
    #[serde(default)]
    pub first_step_s: Option<f64>,
}

/// Each step after a save against the median step without one, in the
/// device's timeline (medians over the rounds after the first), s per save.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct GpuStepExcess {
    /// The median step without a save.
    pub step_s: f64,
    /// The first step after the save: the save's stall, and what it waited for.
    pub first_s: f64,
    /// The three steps after it.
    pub next3_s: f64,
    /// The rest of the interval (work in the background).
    pub rest_s: f64,
    /// Every step's excess, by its place after the save.
    #[serde(default)]
    pub by_place_s: Vec<f64>,
}

/// Medians over the later saves of ckpt's `SaveHandle.phases`, s.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct GpuStallPhases {
    /// The state dicts and the walk of the state.
    pub walk_s: f64,
    /// The host slab chosen and the device-to-host copies started (eager: landed).
    pub device_s: f64,
    /// The engine's save (both engines for a memory tier's step to both tiers).
    pub engine_s: f64,
    /// From the call's entry to the walk (checks, finished saves reaped).
    #[serde(default)]
    pub before_s: f64,
    /// From the engine's save to the return (lazy copies handed to their
    /// thread, the step pre-hooks, the collector on again).
    #[serde(default)]
    pub after_s: f64,
    /// What no phase covers (a memory tier's own work, GIL waits between phases).
    pub other_s: f64,
    /// The whole `save` call.
    pub total_s: f64,
}

/// One target of the GPU issue, as the script judged it.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct GpuTarget {
    /// What is compared, with its bound, e.g. `lazy stall ≤ 10 ms`.
    pub target: String,
    /// The measured value.
    pub value: f64,
    /// The bound.
    pub bound: f64,
    /// Whether it is met.
    pub met: bool,
}

/// What `gpu_bench.py` writes.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct GpuResults {
    /// Why it did not run (no CUDA device, ...), if it did not.
    pub skipped: Option<String>,
    /// The device's name.
    #[serde(default)]
    pub device: Option<String>,
    /// PyTorch's version.
    #[serde(default)]
    pub torch: Option<String>,
    /// The model, optimizer and batch, in words.
    #[serde(default)]
    pub model: Option<String>,
    /// Bytes of model and optimizer state.
    #[serde(default)]
    pub state_bytes: Option<u64>,
    /// One training step without checkpointing, s.
    #[serde(default)]
    pub step_s: Option<f64>,
    /// Steps between checkpoints.
    #[serde(default)]
    pub every: Option<u64>,
    /// The floors.
    #[serde(default)]
    pub floors: Option<GpuFloors>,
    /// One per method.
    #[serde(default)]
    pub methods: Vec<GpuMethod>,
    /// The targets.
    #[serde(default)]
    pub targets: Vec<GpuTarget>,
}

/// Where the script is: `CKPT_EVAL_GPU_SCRIPT`, else `evaluator/python/` of
/// the source tree this binary was built from.
pub fn script_path() -> PathBuf {
    crate::python::source_path("CKPT_EVAL_GPU_SCRIPT", "python/gpu_bench.py")
}

impl Gpu {
    fn args(&self) -> Vec<String> {
        let mut v = Vec::new();
        for (flag, x) in [
            ("--layers", self.gpu_layers),
            ("--width", self.gpu_width),
            ("--seq", self.gpu_seq),
            ("--batch", self.gpu_batch),
            ("--every", self.gpu_every),
            ("--rounds", self.gpu_rounds),
        ] {
            if let Some(x) = x {
                v.push(flag.to_owned());
                v.push(x.to_string());
            }
        }
        v
    }
}

#[async_trait::async_trait]
impl Experiment for Gpu {
    fn name(&self) -> &'static str {
        "gpu"
    }

    fn about(&self, _ctx: &Ctx) -> String {
        let args = self.args();
        let model = if args.is_empty() {
            "gpu_bench.py's default model, 4 GiB of state".to_owned()
        } else {
            args.join(" ")
        };
        format!("a GPT-style model's training loop on one CUDA device, checkpointed by each method ({model})")
    }

    fn estimate_s(&self, _ctx: &Ctx) -> f64 {
        // Seconds where there is no CUDA device (the script says so and stops).
        10.0
    }

    fn unavailable(&self, ctx: &Ctx) -> Option<String> {
        let script = script_path();
        if !script.exists() {
            return Some(format!("its script {} is absent", script.display()));
        }
        python_missing(ctx.python.as_deref(), "torch")
    }

    async fn run(&self, ctx: &Ctx) -> Result<Output, Error> {
        let py = ctx.python.as_deref().ok_or("no Python interpreter")?;
        let script = script_path();
        let dir = ctx.fresh_dir("gpu")?;
        let json = dir.join("gpu.json");
        let mut cmd = Command::new(py);
        cmd.current_dir(script.parent().unwrap_or(Path::new(".")))
            .arg(&script)
            .arg("--dir")
            .arg(dir.join("work"))
            .arg("--json")
            .arg(&json)
            .args(self.args());
        let (ok, stdout, stderr) = run_bounded(cmd, Duration::from_secs(900), "gpu_bench.py")?;
        let written = std::fs::read(&json);
        let _ = std::fs::remove_dir_all(&dir);
        let r: GpuResults = match (ok, written) {
            (true, Ok(bytes)) => serde_json::from_slice(&bytes)?,
            _ => {
                return Err(format!(
                    "gpu_bench.py failed:\n{}",
                    tail(&format!("{stdout}\n{stderr}"), 12)
                )
                .into())
            }
        };
        Ok(render(&r))
    }
}

fn ms(v: Option<f64>) -> String {
    v.map_or_else(String::new, |s| format!("{:.2}", s * 1e3))
}

fn s(v: Option<f64>) -> String {
    v.map_or_else(String::new, |s| format!("{s:.3}"))
}

fn gib(v: Option<u64>) -> String {
    v.map_or_else(String::new, |b| {
        format!("{:.2}", b as f64 / (1u64 << 30) as f64)
    })
}

/// Where ckpt's later stalls went, for the methods that timed it; beside
/// each, the stall as the loop timed it around the call.
fn phases_table(r: &GpuResults) -> Option<Table> {
    let timed: Vec<(&GpuMethod, &GpuStallPhases)> = r
        .methods
        .iter()
        .filter_map(|m| m.stall_phases.as_ref().map(|p| (m, p)))
        .collect();
    if timed.is_empty() {
        return None;
    }
    let mut t = Table::new(
        "gpu-stall",
        "GPU: where ckpt's later saves' stall went (medians, timed inside save; the loop's figure times the call from outside)"
            .to_owned(),
        &[
            "method",
            "before ms",
            "walk ms",
            "device ms",
            "engine ms",
            "after ms",
            "other ms",
            "inside save ms",
            "loop's stall ms",
        ],
    );
    for (m, p) in timed {
        t.rows.push(vec![
            m.method.clone(),
            ms(Some(p.before_s)),
            ms(Some(p.walk_s)),
            ms(Some(p.device_s)),
            ms(Some(p.engine_s)),
            ms(Some(p.after_s)),
            ms(Some(p.other_s)),
            ms(Some(p.total_s)),
            ms(m.stall_later_s),
        ]);
    }
    Some(t)
}

/// Where each method's slowdown went: the steps after a save, against a
/// step without one (the no-checkpoint control's row is the noise).
fn excess_table(r: &GpuResults) -> Option<Table> {
    let rows: Vec<(&GpuMethod, &GpuStepExcess)> = r
        .methods
        .iter()
        .filter_map(|m| m.step_excess.as_ref().map(|x| (m, x)))
        .collect();
    if rows.is_empty() {
        return None;
    }
    let mut t = Table::new(
        "gpu-steps",
        "GPU: where the loop's slowdown went, per save: the steps after it against a step without one \
         (device timeline, medians over the later rounds)"
            .to_owned(),
        &[
            "method",
            "step ms",
            "first step +ms",
            "next 3 steps +ms",
            "rest +ms",
            "total +ms",
        ],
    );
    for (m, x) in rows {
        t.rows.push(vec![
            m.method.clone(),
            ms(Some(x.step_s)),
            ms(Some(x.first_s)),
            ms(Some(x.next3_s)),
            ms(Some(x.rest_s)),
            ms(Some(x.first_s + x.next3_s + x.rest_s)),
        ]);
    }
    Some(t)
}

/// The report's view of what the script wrote: the methods table with the
/// floors in its title, the targets; or, when it did not run, why.
pub fn render(r: &GpuResults) -> Output {
    let mut out = Output::of(r);
    if let Some(why) = &r.skipped {
        out.not_run = Some(why.clone());
        return out;
    }
    let floors = r.floors.as_ref().map_or_else(
        || "floors not measured".to_owned(),
        |f| {
            format!(
                "floors: device to host {:.3} s, host to device {:.3} s, write + fsync {:.3} s, cold read {:.3} s",
                f.d2h_s, f.h2d_s, f.write_fsync_s, f.cold_read_s
            )
        },
    );
    let mut t = Table::new(
        "gpu",
        format!(
            "GPU: {} on {} (torch {}), {:.2} GiB of state, a step of {:.3} s, a checkpoint every {} steps; {floors}",
            r.model.as_deref().unwrap_or("a model"),
            r.device.as_deref().unwrap_or("a CUDA device"),
            r.torch.as_deref().unwrap_or("?"),
            r.state_bytes.unwrap_or(0) as f64 / (1u64 << 30) as f64,
            r.step_s.unwrap_or(f64::NAN),
            r.every.unwrap_or(0),
        ),
        &[
            "method", "first step s", "stall first ms", "stall later ms", "step wait ms", "slowdown %",
            "durable s", "restore warm s", "restore cold s", "pinned peak GiB", "host peak GiB",
        ],
    );
    for m in &r.methods {
        if let Some(e) = &m.error {
            t.push_note_row(vec![m.method.clone()], format!("failed: {e}"));
            continue;
        }
        t.rows.push(vec![
            m.method.clone(),
            s(m.first_step_s),
            ms(m.stall_first_s),
            ms(m.stall_later_s),
            ms(m.step_wait_s),
            m.slowdown
                .map_or_else(String::new, |x| format!("{:+.1}", x * 100.0)),
            s(m.durable_s),
            s(m.restore_warm_s),
            s(m.restore_cold_s),
            gib(m.pinned_peak_bytes),
            gib(m.host_peak_bytes),
        ]);
    }
    out.tables.push(t);
    if let Some(t) = phases_table(r) {
        out.tables.push(t);
    }
    if let Some(t) = excess_table(r) {
        out.tables.push(t);
    }
    out.targets = r
        .targets
        .iter()
        .map(|x| Target {
            what: x.target.clone(),
            ratio: x.value,
            bound: x.bound,
            met: x.met,
        })
        .collect();
    out
}
