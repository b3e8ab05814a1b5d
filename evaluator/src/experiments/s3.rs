//! S3: ckpt's save and load on an S3 server, beside what the server gives a
//! plain client of the same bytes in the same run.
//!
//! The baseline is `object_store` itself, as any program would use it: the
//! state's bytes as one object, uploaded in parts (`WriteMultipart`, the part
//! size and parts in flight of ckpt's own large uploads), and read back by
//! parallel ranged GETs (the chunk size, `load_concurrency` in flight). ckpt
//! saves the same state in its native format (one object per chunk) and in
//! safetensors (one object per rank), until committed, and loads it with a
//! fresh checkpointer; each load is checked equal to the state. Every object is
//! deleted after its repeat.
//!
//! Beside them, from Python (`evaluator/python/s3_dcp_bench.py`, one
//! process): `dcp.save`/`dcp.load` through s3torchconnector's DCP storage,
//! through ckpt's (`ckpt.dcp`), and ckpt's own `Checkpointer`, on a state of
//! the same size, each save after every byte changed.
//!
//! Needs a server: `ckpt-eval s3 --s3-url s3://bucket/prefix` with the usual
//! `AWS_*` variables (`scripts/garage.sh start` prints them for a Garage node
//! on loopback). The target: ckpt's save and load at least 0.9x the baseline's
//! throughput, i.e. at most 1.11x its time.

use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use ckpt_core::{CheckpointerOptions, State, WriteOptions};
use futures::{StreamExt, TryStreamExt};
use object_store::path::Path;
use object_store::{ObjectStore, ObjectStoreExt, WriteMultipart};
use serde::Serialize;

use std::process::Command;
use std::time::Duration;

use super::script::{last_json, python_missing, run_bounded};
use super::Error;
use super::{Ctx, Experiment, Output, Target};
use crate::limits::Limits;
use crate::python::write_bench_script;
use crate::stats::Summary;
use crate::table::{mib, secs, Table};

/// The DCP storage peers' script.
const DCP_SCRIPT: &str = include_str!("../../python/s3_dcp_bench.py");

/// Bound of ckpt's time over the baseline's (0.9x its throughput).
pub const S3_BOUND: f64 = 1.0 / 0.9;

/// Part size of the baseline's multipart upload (ckpt's own part size).
const PART: usize = 16 << 20;

/// Settings of the S3 experiment.
#[derive(Debug, Clone)]
pub struct S3Bench {
    /// Root under which every repeat writes its own prefix.
    pub url: String,
    /// Timed saves and loads per method.
    pub repeats: usize,
}

/// One way to move the state, measured.
#[derive(Debug, Clone, Serialize)]
pub struct S3Row {
    /// `object_store multipart / ranged`, `ckpt native`, `ckpt safetensors`.
    pub name: String,
    /// Upload (ckpt: until committed), seconds.
    pub save_s: Summary,
    /// Download (ckpt: `load_latest` with a fresh checkpointer), seconds.
    pub load_s: Summary,
    /// Raw bytes over the median save time, GB/s.
    pub save_gbps: f64,
    /// Raw bytes over the median load time, GB/s.
    pub load_gbps: f64,
    /// Objects one save wrote.
    pub objects: u64,
}

/// Results of the S3 experiment.
#[derive(Debug, Clone, Serialize)]
pub struct S3Results {
    /// The server's endpoint (`AWS_ENDPOINT`), for the report.
    pub endpoint: String,
    /// Raw bytes of the state.
    pub state_bytes: u64,
    /// Tensors in the state.
    pub tensors: usize,
    /// Uploads in flight (ckpt's write concurrency, the baseline's parts in flight).
    pub write_concurrency: usize,
    /// Reads in flight (ckpt's load concurrency, the baseline's ranged GETs).
    pub read_concurrency: usize,
    /// Baseline first.
    pub rows: Vec<S3Row>,
    /// ckpt native against the baseline.
    pub targets: Vec<Target>,
}

/// Why the experiment cannot run here, if it cannot.
pub fn unavailable(url: Option<&str>) -> Option<String> {
    let Some(url) = url else {
        return Some("no S3 server (give --s3-url s3://bucket/prefix and the AWS_* variables; scripts/garage.sh start prints them for a local Garage node)".into());
    };
    if !cfg!(feature = "s3") {
        return Some(format!(
            "this ckpt-eval was built without the `s3` feature, so {url} cannot be opened"
        ));
    }
    None
}

async fn delete_all(store: &Arc<dyn ObjectStore>) -> Result<(), Error> {
    let keys = store.list(None).map_ok(|m| m.location).boxed();
    store.delete_stream(keys).try_collect::<Vec<_>>().await?;
    Ok(())
}

impl S3Bench {
    /// Run on `state`.
    pub async fn run(&self, state: &State) -> Result<S3Results, Error> {
        let opts = CheckpointerOptions::default();
        let write = WriteOptions::default();
        let (wc, rc, chunk) = (
            write.concurrency.max(1),
            opts.load_concurrency.max(1),
            write.chunk_size.max(1),
        );
        let raw = state.nbytes();
        let mut rows = Vec::new();

        // The baseline: one object of the state's bytes.
        let (mut save, mut load) = (vec![], vec![]);
        for rep in 0..self.repeats.max(1) {
            let store = ckpt_core::store::open_url(&format!("{}/baseline-{rep}", self.url))?;
            let key = Path::from("state.bin");
            let t = Instant::now();
            let upload = store.put_multipart(&key).await?;
            let mut w = WriteMultipart::new_with_chunk_size(upload, PART);
            for tensor in &state.tensors {
                w.wait_for_capacity(wc).await?;
                w.put(tensor.data.clone());
            }
            w.finish().await?;
            save.push(t.elapsed().as_secs_f64());

            let t = Instant::now();
            let ranges: Vec<_> = (0..raw)
                .step_by(chunk)
                .map(|o| o..(o + chunk as u64).min(raw))
                .collect();
            let parts: Vec<Bytes> = futures::stream::iter(ranges)
                .map(|r| {
                    let (store, key) = (store.clone(), key.clone());
                    async move { store.get_range(&key, r).await }
                })
                .buffered(rc)
                .try_collect()
                .await?;
            load.push(t.elapsed().as_secs_f64());
            let mut at = 0usize;
            let whole: Vec<u8> = parts.concat();
            for tensor in &state.tensors {
                let n = tensor.data.len();
                if whole.get(at..at + n) != Some(tensor.data.as_ref()) {
                    return Err(
                        format!("baseline: tensor {} read back differently", tensor.name).into(),
                    );
                }
                at += n;
            }
            delete_all(&store).await?;
        }
        rows.push(row("object_store multipart / ranged", &save, &load, raw, 1));

        for fmt in ["native", "safetensors"] {
            let (mut save, mut load, mut objects) = (vec![], vec![], 0);
            for rep in 0..self.repeats.max(1) {
                let url = format!("{}/ckpt-{fmt}-{rep}", self.url);
                let cp = ckpt_formats::builder(url.as_str())
                    .format(ckpt_formats::by_name(fmt)?)
                    .build()
                    .await?;
                let t = Instant::now();
                let report = cp.save(1, state).await?.wait().await?;
                save.push(t.elapsed().as_secs_f64());
                objects = report.objects;
                drop(cp);
                let cp = ckpt_formats::builder(url.as_str()).build().await?;
                let t = Instant::now();
                let loaded = cp
                    .load_latest()
                    .await?
                    .ok_or("checkpoint not found on S3")?;
                load.push(t.elapsed().as_secs_f64());
                if loaded.state.tensors != state.tensors {
                    return Err(format!("ckpt {fmt}: loaded tensors differ on S3").into());
                }
                delete_all(cp.store()).await?;
            }
            rows.push(row(&format!("ckpt {fmt}"), &save, &load, raw, objects));
        }

        let base = &rows[0];
        let mut targets = Vec::new();
        if let Some(native) = rows.iter().find(|r| r.name == "ckpt native") {
            targets.push(Target::new(
                "S3: ckpt native save / multipart upload (time; <= 1.11 is >= 0.9x throughput)",
                native.save_s.median / base.save_s.median,
                S3_BOUND,
            ));
            targets.push(Target::new(
                "S3: ckpt native load / ranged download (time; <= 1.11 is >= 0.9x throughput)",
                native.load_s.median / base.load_s.median,
                S3_BOUND,
            ));
        }
        Ok(S3Results {
            endpoint: std::env::var("AWS_ENDPOINT").unwrap_or_else(|_| "AWS".into()),
            state_bytes: raw,
            tensors: state.tensors.len(),
            write_concurrency: wc,
            read_concurrency: rc,
            rows,
            targets,
        })
    }
}

fn row(name: &str, save: &[f64], load: &[f64], raw: u64, objects: u64) -> S3Row {
    let (save_s, load_s) = (Summary::of(save), Summary::of(load));
    S3Row {
        name: name.to_owned(),
        save_gbps: Limits::gbps(raw, save_s.median),
        load_gbps: Limits::gbps(raw, load_s.median),
        save_s,
        load_s,
        objects,
    }
}

/// The S3 experiment (on the shared state); its server is the suite's
/// `--s3-url` ([`Ctx::s3_url`]).
#[derive(clap::Args, Debug, Clone, Default)]
pub struct S3 {}

#[async_trait::async_trait]
impl Experiment for S3 {
    fn name(&self) -> &'static str {
        "s3"
    }

    fn about(&self, ctx: &Ctx) -> String {
        format!(
            "{} MiB to {} and back",
            ctx.spec.mib,
            ctx.s3_url.as_deref().unwrap_or("")
        )
    }

    fn estimate_s(&self, ctx: &Ctx) -> f64 {
        20.0 * ctx.repeats as f64 * ctx.spec.mib as f64 / 1024.0
    }

    fn unavailable(&self, ctx: &Ctx) -> Option<String> {
        unavailable(ctx.s3_url.as_deref())
    }

    async fn run(&self, ctx: &Ctx) -> Result<Output, Error> {
        let shared = ctx.state().await?;
        let url = ctx.s3_url.clone().unwrap_or_default();
        let r = S3Bench {
            url: url.clone(),
            repeats: ctx.repeats,
        }
        .run(&shared.0)
        .await?;
        let mut out = Output::of(&r);
        out.tables.push(table(&r));
        out.targets = r.targets.clone();
        let imports = "torch.distributed.checkpoint, ckpt.dcp, s3torchconnector.dcp";
        match python_missing(ctx.python.as_deref(), imports) {
            Some(why) => out
                .notes
                .push(format!("s3: DCP storage peers not run: {why}")),
            None => {
                let py = ctx.python.clone().ok_or("no Python interpreter")?;
                let (mib, repeats) = (ctx.spec.mib as f64, ctx.repeats);
                let peers = format!("{}/dcp-peers", url.trim_end_matches('/'));
                match dcp_peers(&py, &peers, mib, repeats, &ctx.fresh_dir("s3-dcp")?).await {
                    Ok(v) => {
                        out.tables.push(dcp_table(&v, r.endpoint.as_str()));
                        out.targets.extend(dcp_targets(&v));
                        out.results = serde_json::json!({"native": out.results, "dcp_peers": v});
                    }
                    Err(e) => out.notes.push(format!("s3: DCP storage peers failed: {e}")),
                }
            }
        }
        Ok(out)
    }
}

/// Run `s3_dcp_bench.py` with `py` in the scratch directory `dir` (removed
/// after), writing under `url` (emptied before and after); its JSON.
pub async fn dcp_peers(
    py: &std::path::Path,
    url: &str,
    mib: f64,
    repeats: usize,
    dir: &std::path::Path,
) -> Result<serde_json::Value, Error> {
    let store = ckpt_core::store::open_url(url)?;
    delete_all(&store).await?;
    let script = write_bench_script(dir, "s3_dcp_bench.py", DCP_SCRIPT)?;
    let mut cmd = Command::new(py);
    cmd.current_dir(dir)
        .arg(&script)
        .args(["--url", url, "--mib"])
        .arg(mib.to_string())
        .arg("--repeats")
        .arg(repeats.max(1).to_string());
    let ran = tokio::task::spawn_blocking(move || {
        run_bounded(cmd, Duration::from_secs(900), "s3_dcp_bench.py")
    })
    .await?;
    delete_all(&store).await?;
    let _ = std::fs::remove_dir_all(dir);
    let (ok, stdout, stderr) = ran?;
    last_json(ok, &stdout, &stderr, "s3_dcp_bench.py")
}

fn summary(v: &serde_json::Value) -> Option<Summary> {
    let xs: Vec<f64> = v.as_array()?.iter().filter_map(|x| x.as_f64()).collect();
    (!xs.is_empty()).then(|| Summary::of(&xs))
}

/// The DCP storage peers' table: save until stored, load checked equal.
pub fn dcp_table(v: &serde_json::Value, endpoint: &str) -> Table {
    let bytes = v["state_bytes"].as_f64().unwrap_or(0.0);
    let mut t = Table::new(
        "s3_dcp",
        format!(
            "S3 ({endpoint}) from Python: dcp.save/dcp.load through s3torchconnector's S3StorageWriter/S3StorageReader, through ckpt.dcp's StorageWriter/StorageReader, and ckpt's own Checkpointer (save + wait, load_latest by a fresh one); {} MiB in {} tensors, every byte changed before each save, one process (torch {}); median [min-max] of {} after a cold save and load; each load checked equal",
            mib(bytes),
            v["tensors"].as_u64().unwrap_or(0),
            v["torch"].as_str().unwrap_or("?"),
            v["repeats"].as_u64().unwrap_or(0),
        ),
        &["method", "save s", "load s", "save GB/s", "load GB/s"],
    );
    for m in v["methods"].as_array().into_iter().flatten() {
        let name = m["name"].as_str().unwrap_or("?").to_owned();
        if let Some(why) = m["skipped"].as_str() {
            t.rows.push(vec![
                name,
                format!("not run: {why}"),
                String::new(),
                String::new(),
                String::new(),
            ]);
            continue;
        }
        let (Some(save), Some(load)) = (summary(&m["save_s"]), summary(&m["load_s"])) else {
            continue;
        };
        t.rows.push(vec![
            name,
            secs(&save),
            secs(&load),
            format!("{:.2}", bytes / save.median / 1e9),
            format!("{:.2}", bytes / load.median / 1e9),
        ]);
    }
    t
}

/// ckpt's DCP storage and its Checkpointer against s3torchconnector's, as
/// ratios of median times (bound 1.0: no slower than the storage S3 users pick).
pub fn dcp_targets(v: &serde_json::Value) -> Vec<Target> {
    let median = |name: &str, key: &str| {
        v["methods"]
            .as_array()?
            .iter()
            .find(|m| m["name"] == name && m["skipped"].is_null())
            .and_then(|m| summary(&m[key]))
            .map(|s| s.median)
    };
    let peer = "s3torchconnector dcp.save";
    let mut out = Vec::new();
    for ours in ["dcp.save -> ckpt", "ckpt Checkpointer"] {
        for (key, what) in [("save_s", "save"), ("load_s", "load")] {
            if let (Some(a), Some(b)) = (median(ours, key), median(peer, key)) {
                out.push(Target {
                    what: format!("S3, {ours}: {what} / s3torchconnector's DCP storage"),
                    ratio: a / b,
                    bound: 1.0,
                    met: a / b <= 1.0,
                });
            }
        }
    }
    out
}

/// The S3 experiment: ckpt beside the plain transfers, then its targets.
pub fn table(s: &S3Results) -> Table {
    let mut t = Table::new(
        "s3",
        format!(
            "S3 ({}): {} MiB in {} tensors; median [min-max] of {} runs; baseline = one object by object_store, {} parts of 16 MiB in flight up, {} ranged GETs in flight down; ckpt = until committed, and load_latest with a fresh checkpointer",
            s.endpoint,
            mib(s.state_bytes as f64),
            s.tensors,
            s.rows.first().map_or(0, |x| x.save_s.n),
            s.write_concurrency,
            s.read_concurrency
        ),
        &["method", "save s", "load s", "save GB/s", "load GB/s", "objects/save"],
    );
    for x in &s.rows {
        t.rows.push(vec![
            x.name.clone(),
            secs(&x.save_s),
            secs(&x.load_s),
            format!("{:.2}", x.save_gbps),
            format!("{:.2}", x.load_gbps),
            x.objects.to_string(),
        ]);
    }
    t
}
