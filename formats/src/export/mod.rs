//! `ckpt export`: the tensors of one entry of a checkpoint (`model`), unsharded,
//! without ckpt's internal tensors, as files for inference.
//!
//! Names are the entry's state-dict keys (`transformer.h.0.attn.c_attn.weight` for
//! the entry `model`), so `model.load_state_dict` and Hugging Face's
//! `from_pretrained` take them as they are. Sharded tensors are assembled; tensors
//! are read a batch at a time and written as they come, so a safetensors export
//! holds at most [`BATCH_BYTES`] (or one tensor, if larger) in memory. With `hf`,
//! the output is a directory in Hugging Face's layout: `model.safetensors`, or
//! `model-0000k-of-0000n.safetensors` files of at most `max_shard_bytes` each with
//! `model.safetensors.index.json`.

pub mod cast;
mod write;

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};

use ckpt_core::{CheckpointId, DType, Error, Manifest, Result, Value};

use crate::pylayout;

/// Hugging Face's default largest shard (`max_shard_size="5GB"`).
pub const HF_SHARD_BYTES: u64 = 5_000_000_000;
/// Tensor bytes read per batch while writing.
pub const BATCH_BYTES: u64 = 256 << 20;

/// File format of an export.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExportFormat {
    /// `.safetensors` (streamed).
    Safetensors,
    /// A torch `.pt` file holding a flat state dict (built in memory).
    Pt,
}

impl std::str::FromStr for ExportFormat {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "safetensors" => Ok(ExportFormat::Safetensors),
            "pt" | "torch" => Ok(ExportFormat::Pt),
            _ => Err(Error::InvalidInput(format!(
                "export format `{s}`: safetensors or pt"
            ))),
        }
    }
}

/// What to export.
#[derive(Debug, Clone)]
pub struct ExportOptions {
    /// The top-level entry of the saved state (`model`).
    pub entry: String,
    /// Output file format.
    pub format: ExportFormat,
    /// Cast floating-point tensors to this dtype (bf16, f16, f32).
    pub dtype: Option<DType>,
    /// Write Hugging Face's layout into the output directory.
    pub hf: bool,
    /// Step to export (default: the newest committed checkpoint).
    pub step: Option<u64>,
    /// Largest file of an `hf` export.
    pub max_shard_bytes: u64,
    /// A `config.json` to copy into an `hf` export.
    pub config: Option<PathBuf>,
}

impl ExportOptions {
    /// Export `entry` as one safetensors file, dtypes as saved.
    pub fn new(entry: impl Into<String>) -> Self {
        ExportOptions {
            entry: entry.into(),
            format: ExportFormat::Safetensors,
            dtype: None,
            hf: false,
            step: None,
            max_shard_bytes: HF_SHARD_BYTES,
            config: None,
        }
    }
}

/// What an export wrote.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExportReport {
    /// The step exported.
    pub step: u64,
    /// Tensors written.
    pub tensors: usize,
    /// Tensor bytes written.
    pub bytes: u64,
    /// Files written, in order.
    pub files: Vec<PathBuf>,
}

/// One tensor to export.
#[derive(Debug, Clone)]
pub(crate) struct Item {
    /// Its name in the checkpoint.
    pub src: String,
    /// Its name in the export.
    pub out: String,
    /// Dtype after casting.
    pub dtype: DType,
    /// Whole (global) shape.
    pub shape: Vec<u64>,
    /// Stored as pieces of several ranks.
    pub sharded: bool,
    /// Bytes after casting.
    pub nbytes: u64,
}

/// The state tree of a manifest as plain data, if it has one.
fn plain_tree(m: &Manifest) -> Option<Value> {
    match pylayout::python_state(&m.meta) {
        Some((_, state)) => Some(pylayout::plain(state)),
        None if matches!(m.meta, Value::Map(_)) => Some(m.meta.clone()),
        None => None,
    }
}

/// The entries of a checkpoint that hold tensors (for the error of a wrong entry).
pub fn entries(m: &Manifest) -> Vec<String> {
    let mut out = Vec::new();
    if let Some(Value::Map(top)) = plain_tree(m) {
        for (k, v) in &top {
            let mut refs = Vec::new();
            v.tensor_refs(&mut refs);
            if !refs.is_empty() {
                out.push(match k {
                    ckpt_core::Key::Str(s) => s.clone(),
                    ckpt_core::Key::Int(i) => i.to_string(),
                });
            }
        }
    }
    if out.is_empty() {
        let mut seen = HashSet::new();
        for t in m.tensors.iter().filter(|t| !pylayout::is_internal(&t.name)) {
            let head = t.name.split('.').next().unwrap_or(&t.name);
            if seen.insert(head) {
                out.push(head.to_owned());
            }
        }
    }
    out
}

/// The tensors of `entry`, with their export names, in state order.
pub(crate) fn select(m: &Manifest, entry: &str, dtype: Option<DType>) -> Result<Vec<Item>> {
    let mut records = HashMap::new();
    for r in &m.tensors {
        records.entry(r.name.as_str()).or_insert(r);
    }
    let mut paths = Vec::new();
    match plain_tree(m).as_ref().and_then(|t| t.get(entry)) {
        Some(Value::Tensor(name)) => paths.push((entry.to_owned(), name.clone())),
        Some(sub) => pylayout::tensor_paths(sub, "", &mut paths),
        None => {
            let prefix = format!("{entry}.");
            for r in &m.tensors {
                if r.name == entry && !paths.iter().any(|(_, n)| n == entry) {
                    paths.push((entry.to_owned(), r.name.clone()));
                } else if let Some(rest) = r.name.strip_prefix(&prefix) {
                    if !pylayout::is_internal(&r.name) && !paths.iter().any(|(_, n)| n == &r.name) {
                        paths.push((rest.to_owned(), r.name.clone()));
                    }
                }
            }
        }
    }
    if paths.is_empty() {
        return Err(Error::NotFound {
            what: format!(
                "entry `{entry}` with tensors in checkpoint {}; its entries are: {}",
                m.id(),
                entries(m).join(", ")
            ),
        });
    }
    paths
        .into_iter()
        .map(|(out, src)| {
            let r = records.get(src.as_str()).ok_or_else(|| {
                Error::corrupt(
                    "manifest",
                    Some(&src),
                    "the state references a tensor it lacks",
                )
            })?;
            let shape = match &r.shard {
                Some(s) => s.global_shape.clone(),
                None => r.shape.clone(),
            };
            let to = cast::cast_dtype(r.dtype, dtype);
            let numel = ckpt_core::numel(&shape)?;
            Ok(Item {
                src,
                out,
                dtype: to,
                nbytes: to.byte_len(numel)?,
                shape,
                sharded: r.shard.is_some(),
            })
        })
        .collect()
}

/// The checkpoint of `step` (newest attempt), or the newest committed one.
async fn pick(cp: &ckpt_core::Checkpointer, url: &str, step: Option<u64>) -> Result<CheckpointId> {
    let ids = cp.committed().await?;
    match step {
        Some(s) => ids.into_iter().rev().find(|i| i.step == s),
        None => ids.into_iter().next_back(),
    }
    .ok_or_else(|| Error::NotFound {
        what: match step {
            Some(s) => format!("a committed checkpoint of step {s} under `{url}`"),
            None => format!("a committed checkpoint under `{url}`"),
        },
    })
}

/// Export one entry of the checkpoint under `url` to `out` (a file, or with `hf`
/// a directory). Existing files are never overwritten.
pub async fn export(url: &str, out: &Path, opts: &ExportOptions) -> Result<ExportReport> {
    if opts.hf && opts.format != ExportFormat::Safetensors {
        return Err(Error::InvalidInput(
            "an --hf export is written as safetensors".into(),
        ));
    }
    if let Some(d) = opts.dtype {
        if !cast::TARGETS.contains(&d) {
            return Err(Error::InvalidInput(format!(
                "an export casts floats to bf16, f16 or f32, not {}",
                d.name()
            )));
        }
    }
    let cp = crate::builder(url).read_only().build().await?;
    let id = pick(&cp, url, opts.step).await?;
    let manifest = cp.manifest(&id).await?;
    let items = select(&manifest, &opts.entry, opts.dtype)?;
    let src = write::Source {
        cp: &cp,
        id: &id,
        dtype: opts.dtype,
    };
    let files = if opts.hf {
        write::hf_dir(
            &src,
            &items,
            out,
            opts.max_shard_bytes,
            opts.config.as_deref(),
        )
        .await?
    } else {
        match opts.format {
            ExportFormat::Safetensors => {
                write::safetensors_file(&src, &items, out).await?;
                vec![out.to_owned()]
            }
            ExportFormat::Pt => {
                write::pt_file(&src, &items, out).await?;
                vec![out.to_owned()]
            }
        }
    };
    Ok(ExportReport {
        step: id.step,
        tensors: items.len(),
        bytes: items.iter().map(|i| i.nbytes).sum(),
        files,
    })
}

#[cfg(test)]
mod tests;
