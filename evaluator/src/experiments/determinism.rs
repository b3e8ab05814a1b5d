//! Determinism:
//!
//! - the same state saved twice (two checkpointers, two roots), in every format,
//!   gives byte-identical data objects (blake3 of every stored object except the
//!   manifests, which carry a random attempt id and a time) and identical tensor
//!   records; the same for an eager and a lazy snapshot of mutable buffers, and
//!   for one rank against two ranks of an in-process group holding the state;
//! - a training run (a small real model, [`crate::train`]) resumed from a
//!   checkpoint by a fresh checkpointer ends bitwise equal to an uninterrupted run;
//!   the same for a real PyTorch model trained by the Python script, its state
//!   (with the RNG state) saved and loaded through ckpt.

use std::collections::BTreeMap;
use std::path::Path;

use ckpt_core::testing::InProcessGroup;
use ckpt_core::{SnapshotMode, State};
use serde::Serialize;

use super::{file_url, Ctx, Error, Experiment, Output};
use crate::python;
use crate::table::Table;
use crate::train::Trainer;
use crate::workload::Params;

/// One check.
#[derive(Debug, Clone, Serialize)]
pub struct Check {
    /// What was compared.
    pub what: String,
    /// Objects (or tensors) compared.
    pub compared: usize,
    /// Whether they were identical.
    pub identical: bool,
    /// A hash or the first difference.
    pub detail: String,
}

/// Results of the determinism experiment.
#[derive(Debug, Clone, Serialize)]
pub struct DeterminismResults {
    /// Every check.
    pub checks: Vec<Check>,
    /// All identical.
    pub all_identical: bool,
}

/// Settings of the determinism experiment.
#[derive(Debug, Clone)]
pub struct DeterminismBench {
    /// Training steps of the resume check.
    pub steps: u64,
    /// Step at which the interrupted run checkpoints and stops.
    pub stop_at: u64,
}

/// blake3 of every file under `root` except manifests, counted by hash.
pub fn object_hashes(root: &Path) -> BTreeMap<String, usize> {
    fn walk(dir: &Path, out: &mut BTreeMap<String, usize>) {
        for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
            let p = e.path();
            if p.is_dir() {
                // Commit records and writer-epoch claims hold times and
                // random ids; the data is what must be the same.
                if p.file_name()
                    .is_some_and(|n| n != "manifests" && n != "epochs")
                {
                    walk(&p, out);
                }
            } else if let Ok(bytes) = std::fs::read(&p) {
                *out.entry(blake3::hash(&bytes).to_hex().to_string())
                    .or_default() += 1;
            }
        }
    }
    let mut out = BTreeMap::new();
    walk(root, &mut out);
    out
}

/// Compare two roots' objects and the tensor records of their manifests.
async fn compare_roots(what: &str, a: &Path, b: &Path) -> Result<Check, Error> {
    let (ha, hb) = (object_hashes(a), object_hashes(b));
    // Object keys of single-file formats contain the save's random attempt id:
    // compare the records with it replaced by a placeholder.
    let records = |mut m: ckpt_core::Manifest| {
        m.tensors.sort_by(|a, b| a.name.cmp(&b.name));
        serde_json::to_string(&m.tensors).map(|s| s.replace(&m.attempt, "<attempt>"))
    };
    let ma = ckpt_formats::builder(file_url(a)).build().await?;
    let mb = ckpt_formats::builder(file_url(b)).build().await?;
    let (ia, ib) = (ma.committed().await?, mb.committed().await?);
    let (ra, rb) = match (ia.last(), ib.last()) {
        (Some(x), Some(y)) => (
            records(ma.manifest(x).await?)?,
            records(mb.manifest(y).await?)?,
        ),
        _ => return Err(format!("{what}: a save did not commit").into()),
    };
    let identical = !ha.is_empty() && ha == hb && ra == rb;
    let detail = if identical {
        let all: String = ha.keys().cloned().collect();
        format!(
            "objects digest {}",
            &blake3::hash(all.as_bytes()).to_hex()[..16]
        )
    } else if ha != hb {
        format!("{} vs {} distinct objects differ", ha.len(), hb.len())
    } else {
        "tensor records differ".to_owned()
    };
    Ok(Check {
        what: what.to_owned(),
        compared: ha.values().sum(),
        identical,
        detail,
    })
}

impl DeterminismBench {
    /// Run on `state`.
    pub async fn run(&self, ctx: &Ctx, state: &State) -> Result<DeterminismResults, Error> {
        let names: Vec<String> = ckpt_formats::registry()
            .names()
            .iter()
            .map(|s| s.to_string())
            .collect();
        let pb = ctx.bar(names.len() as u64 + 4, "determinism");
        let mut checks = Vec::new();
        for fmt in &names {
            pb.set_message(fmt.clone());
            let mut roots = Vec::new();
            for i in 0..2 {
                let dir = ctx.fresh_dir(&format!("determinism-{fmt}-{i}"))?;
                let cp = ckpt_formats::builder(file_url(&dir))
                    .format(ckpt_formats::by_name(fmt)?)
                    .build()
                    .await?;
                cp.save(7, state).await?.wait().await?;
                roots.push(dir);
            }
            checks.push(
                compare_roots(
                    &format!("{fmt}: same state saved twice"),
                    &roots[0],
                    &roots[1],
                )
                .await?,
            );
            roots.iter().for_each(|r| drop(std::fs::remove_dir_all(r)));
            pb.inc(1);
        }

        pb.set_message("eager vs lazy");
        let params = Params::from_state(state);
        let mut roots = Vec::new();
        for (i, mode) in [SnapshotMode::Eager, SnapshotMode::Lazy]
            .into_iter()
            .enumerate()
        {
            let dir = ctx.fresh_dir(&format!("determinism-mode-{i}"))?;
            let cp = ckpt_formats::builder(file_url(&dir))
                .snapshot(mode)
                .build()
                .await?;
            let h = cp.save(7, params.capture()).await?;
            h.wait_snapshot().await?;
            h.wait().await?;
            roots.push(dir);
        }
        checks.push(
            compare_roots(
                "native: eager vs lazy snapshot of mutable buffers",
                &roots[0],
                &roots[1],
            )
            .await?,
        );
        roots.iter().for_each(|r| drop(std::fs::remove_dir_all(r)));
        pb.inc(1);

        pb.set_message("ranks");
        checks.push(self.ranks(ctx, state).await?);
        pb.inc(1);

        pb.set_message("resume");
        checks.push(self.resume(ctx).await?);
        if let Some(py) = &ctx.python {
            pb.set_message("resume (PyTorch)");
            checks.push(self.torch_resume(ctx, py).await?);
        }
        pb.finish_and_clear();
        let all_identical = checks.iter().all(|c| c.identical);
        Ok(DeterminismResults {
            checks,
            all_identical,
        })
    }

    /// The same state saved by one rank, and by two ranks that both hold it (data
    /// parallelism: each writes about half) in an in-process group: the same tensors,
    /// bit for bit, and the same chunk for every tensor large enough to have chunks
    /// of its own. (Small tensors are packed together per rank, so a pack depends on
    /// which tensors a rank writes: packs differ between the two splits.)
    async fn ranks(&self, ctx: &Ctx, state: &State) -> Result<Check, Error> {
        let solo = ctx.fresh_dir("determinism-rank-solo")?;
        let cp = ckpt_formats::builder(file_url(&solo)).build().await?;
        cp.save(7, state).await?.wait().await?;
        let one = cp
            .load_latest()
            .await?
            .ok_or("no checkpoint from one rank")?;
        drop(cp);
        let duo = ctx.fresh_dir("determinism-rank-duo")?;
        let tasks: Vec<_> = InProcessGroup::new(2)
            .into_iter()
            .map(|g| {
                let (url, st) = (file_url(&duo), state.clone());
                tokio::spawn(async move {
                    let cp = ckpt_formats::builder(url).coordinator(g).build().await?;
                    cp.save(7, &st).await?.wait().await?;
                    Ok::<_, ckpt_core::Error>(())
                })
            })
            .collect();
        for t in tasks {
            t.await??;
        }
        let two = ckpt_formats::builder(file_url(&duo))
            .build()
            .await?
            .load_latest()
            .await?
            .ok_or("no checkpoint from two ranks")?;
        let unpacked =
            |m: &ckpt_core::Manifest| -> std::collections::BTreeMap<String, Vec<String>> {
                m.tensors
                    .iter()
                    .filter_map(|t| match &t.layout {
                        ckpt_core::Layout::Chunks { chunks }
                            if chunks.iter().all(|c| c.offset.is_none()) =>
                        {
                            Some((
                                t.name.clone(),
                                chunks.iter().map(|c| c.hash.clone()).collect(),
                            ))
                        }
                        _ => None,
                    })
                    .collect()
            };
        let mut by_name: Vec<(&str, &[u8])> = one
            .state
            .tensors
            .iter()
            .map(|t| (t.name.as_str(), &t.data[..]))
            .collect();
        let mut other: Vec<(&str, &[u8])> = two
            .state
            .tensors
            .iter()
            .map(|t| (t.name.as_str(), &t.data[..]))
            .collect();
        by_name.sort();
        other.sort();
        let (a, b) = (unpacked(&one.manifest), unpacked(&two.manifest));
        let identical = by_name == other && a == b;
        let c = Check {
            what: "native: 1 rank vs 2 ranks holding the same state (tensors, and chunks of unpacked tensors)".into(),
            compared: by_name.len(),
            identical,
            detail: if identical {
                format!("{} tensors, {} with chunks of their own", by_name.len(), a.len())
            } else {
                "the two checkpoints hold different tensors or chunks".into()
            },
        };
        let _ = std::fs::remove_dir_all(&solo);
        let _ = std::fs::remove_dir_all(&duo);
        Ok(c)
    }

    /// A real PyTorch model (MLP with dropout, Adam) trained in Python: its state
    /// at `stop_at` (parameters, Adam moments and steps, the RNG state) goes through
    /// a ckpt save and a load by a fresh checkpointer, Python resumes from what was
    /// loaded, and the final state must equal an uninterrupted run's, bit for bit.
    async fn torch_resume(&self, ctx: &Ctx, py: &Path) -> Result<Check, Error> {
        let dir = ctx.fresh_dir("determinism-torch")?;
        let script = python::write_bench_script(&dir, "baselines.py", python::SCRIPT)?;
        let steps = [
            "--steps".to_string(),
            self.steps.to_string(),
            "--stop-at".into(),
            self.stop_at.to_string(),
        ];
        let first = python::Exported {
            spec: dir.join("none.json"),
            blob: dir.join("none.bin"),
            script: script.clone(),
            work: dir.clone(),
        };
        let args: Vec<String> = ["--phase".into(), "first".into()]
            .into_iter()
            .chain(steps.clone())
            .collect();
        python::run(py, &first, "resume", &args)?;
        let mid = python::import(&dir.join("mid.json"), &dir.join("mid.bin"))?;
        let root = dir.join("ckpt");
        let cp = ckpt_formats::builder(file_url(&root)).build().await?;
        cp.save(self.stop_at, &mid).await?.wait().await?;
        drop(cp);
        let cp = ckpt_formats::builder(file_url(&root)).build().await?;
        let loaded = cp
            .load_latest()
            .await?
            .ok_or("no checkpoint to resume from")?;
        let mut second = python::export(&loaded.state, &dir.join("restored"))?;
        second.work = dir.clone();
        let args: Vec<String> = ["--phase".into(), "second".into()]
            .into_iter()
            .chain(steps)
            .collect();
        python::run(py, &second, "resume", &args)?;
        let straight = python::import(&dir.join("straight.json"), &dir.join("straight.bin"))?;
        let resumed = python::import(&dir.join("resumed.json"), &dir.join("resumed.bin"))?;
        let _ = std::fs::remove_dir_all(&dir);
        let digest = |s: &State| {
            let mut h = blake3::Hasher::new();
            for t in &s.tensors {
                h.update(&t.data);
            }
            h.finalize().to_hex()[..16].to_string()
        };
        Ok(Check {
            what: format!(
                "PyTorch MLP + Adam + RNG: resumed at step {} of {} vs uninterrupted",
                self.stop_at, self.steps
            ),
            compared: straight.tensors.len(),
            identical: !straight.tensors.is_empty() && straight == resumed,
            detail: format!("final state {} vs {}", digest(&straight), digest(&resumed)),
        })
    }

    /// Train `steps` without interruption; train `stop_at`, checkpoint, throw the
    /// trainer and checkpointer away, load with a fresh checkpointer, finish; compare.
    async fn resume(&self, ctx: &Ctx) -> Result<Check, Error> {
        let mut straight = Trainer::new(42);
        for _ in 0..self.steps {
            straight.train_step();
        }
        let dir = ctx.fresh_dir("determinism-resume")?;
        {
            let mut first = Trainer::new(42);
            for _ in 0..self.stop_at {
                first.train_step();
            }
            let cp = ckpt_formats::builder(file_url(&dir)).build().await?;
            cp.save(first.step, first.to_state()).await?.wait().await?;
        }
        let cp = ckpt_formats::builder(file_url(&dir)).build().await?;
        let loaded = cp
            .load_latest()
            .await?
            .ok_or("no checkpoint to resume from")?;
        let mut resumed = Trainer::from_state(&loaded.state)?;
        while resumed.step < self.steps {
            resumed.train_step();
        }
        let _ = std::fs::remove_dir_all(&dir);
        let (a, b) = (straight.to_state(), resumed.to_state());
        let identical = a == b;
        let digest = |s: &State| {
            let mut h = blake3::Hasher::new();
            for t in &s.tensors {
                h.update(&t.data);
            }
            h.finalize().to_hex()[..16].to_string()
        };
        Ok(Check {
            what: format!(
                "MLP + Adam: resumed at step {} of {} vs uninterrupted",
                self.stop_at, self.steps
            ),
            compared: a.tensors.len(),
            identical,
            detail: format!("final state {} vs {}", digest(&a), digest(&b)),
        })
    }
}

/// The determinism experiment (on the shared state; no options).
#[derive(clap::Args, Debug, Clone, Default)]
pub struct Determinism {}

#[async_trait::async_trait]
impl Experiment for Determinism {
    fn name(&self) -> &'static str {
        "determinism"
    }

    fn about(&self, ctx: &Ctx) -> String {
        format!(
            "byte-identical saves of {} MiB in every format, bitwise resume",
            ctx.spec.mib
        )
    }

    fn estimate_s(&self, ctx: &Ctx) -> f64 {
        // Measured on a busy 2-core machine: 14 s for 256 MiB.
        5.0 + 36.0 * ctx.spec.mib as f64 / 1024.0
    }

    async fn run(&self, ctx: &Ctx) -> Result<Output, Error> {
        let shared = ctx.state().await?;
        let d = DeterminismBench {
            steps: 200,
            stop_at: 77,
        }
        .run(ctx, &shared.0)
        .await?;
        let mut out = Output::of(&d);
        out.tables.push(table(&d));
        Ok(out)
    }
}

/// The determinism table.
pub fn table(d: &DeterminismResults) -> Table {
    let mut t = Table::new(
        "determinism",
        "Determinism".into(),
        &["check", "compared", "identical", "detail"],
    );
    for c in &d.checks {
        t.rows.push(vec![
            c.what.clone(),
            c.compared.to_string(),
            if c.identical { "yes" } else { "NO" }.into(),
            c.detail.clone(),
        ]);
    }
    t
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn object_hashes_skip_manifests_and_claims_and_count_duplicates() {
        let d = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(d.path().join("chunks")).unwrap();
        std::fs::create_dir_all(d.path().join("manifests")).unwrap();
        std::fs::write(d.path().join("chunks/a"), b"x").unwrap();
        std::fs::write(d.path().join("chunks/b"), b"x").unwrap();
        std::fs::write(d.path().join("manifests/m"), b"y").unwrap();
        std::fs::create_dir_all(d.path().join("epochs")).unwrap();
        std::fs::write(d.path().join("epochs/e"), b"z").unwrap();
        let h = object_hashes(d.path());
        assert_eq!(h.len(), 1);
        assert_eq!(h.values().sum::<usize>(), 2);
    }
}
