//! Writing an export: streamed safetensors files, Hugging Face's sharded layout,
//! or one `.pt` file.

use std::collections::HashMap;
use std::io::Write;
use std::path::{Path, PathBuf};

use ckpt_core::{CheckpointId, Checkpointer, DType, Error, Result, ShardSpec, State, Tensor};

use super::{cast, Item, BATCH_BYTES};
use crate::safetensors::codec::{encode_header, Entry};

/// Where an export reads its tensors.
pub(crate) struct Source<'a> {
    pub cp: &'a Checkpointer,
    pub id: &'a CheckpointId,
    pub dtype: Option<DType>,
}

impl Source<'_> {
    /// The tensors of `items`, whole, cast and renamed, in order.
    async fn read(&self, items: &[Item]) -> Result<Vec<Tensor>> {
        let plain: Vec<&str> = items
            .iter()
            .filter(|i| !i.sharded)
            .map(|i| i.src.as_str())
            .collect();
        let mut got: HashMap<String, Tensor> = self
            .cp
            .load_tensors(self.id, &plain)
            .await?
            .into_iter()
            .map(|t| (t.name.clone(), t))
            .collect();
        for i in items.iter().filter(|i| i.sharded) {
            let whole = ShardSpec {
                offsets: vec![0; i.shape.len()],
                global_shape: i.shape.clone(),
            };
            let wanted = [(i.src.as_str(), i.shape.clone(), whole)];
            let mut t = self.cp.load_shards(self.id, &wanted).await?.remove(0);
            t.shard = None;
            got.insert(i.src.clone(), t);
        }
        items
            .iter()
            .map(|i| {
                let mut t = got.remove(&i.src).ok_or_else(|| Error::NotFound {
                    what: format!("tensor `{}` in {}", i.src, self.id),
                })?;
                t.name = i.out.clone();
                cast::cast(t, self.dtype)
            })
            .collect()
    }
}

/// Split `items` into runs of at most `max` bytes (a larger tensor gets a run alone).
fn runs(items: &[Item], max: u64) -> Vec<&[Item]> {
    let mut out = Vec::new();
    let (mut start, mut bytes) = (0, 0u64);
    for (i, it) in items.iter().enumerate() {
        if i > start && bytes + it.nbytes > max {
            out.push(&items[start..i]);
            (start, bytes) = (i, 0);
        }
        bytes += it.nbytes;
    }
    if start < items.len() {
        out.push(&items[start..]);
    }
    out
}

/// Refuse to overwrite `path`; the temporary name to write it under.
fn fresh(path: &Path) -> Result<PathBuf> {
    if path.exists() {
        return Err(Error::Conflict(format!(
            "`{}` exists; not overwriting it",
            path.display()
        )));
    }
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".partial");
    Ok(PathBuf::from(tmp))
}

/// One safetensors file of `items`: the header first (shapes are known from the
/// manifest), then the tensors a batch at a time.
pub(crate) async fn safetensors_file(src: &Source<'_>, items: &[Item], path: &Path) -> Result<()> {
    let tmp = fresh(path)?;
    let entries: Vec<Entry<'_>> = items
        .iter()
        .map(|i| Entry {
            name: &i.out,
            dtype: i.dtype,
            shape: &i.shape,
            len: i.nbytes,
        })
        .collect();
    let meta = HashMap::from([("format".to_owned(), "pt".to_owned())]);
    let header = encode_header(&entries, Some(meta))
        .map_err(|e| Error::InvalidInput(format!("cannot write `{}`: {e}", path.display())))?;
    let mut f = std::io::BufWriter::new(std::fs::File::create(&tmp)?);
    f.write_all(&header.bytes)?;
    for batch in runs(items, BATCH_BYTES) {
        for t in src.read(batch).await? {
            f.write_all(&t.data)?;
        }
    }
    let f = f.into_inner().map_err(|e| e.into_error())?;
    f.sync_all()?;
    std::fs::rename(&tmp, path)?;
    Ok(())
}

/// One `.pt` file holding `{name: tensor}` (built in memory).
pub(crate) async fn pt_file(src: &Source<'_>, items: &[Item], path: &Path) -> Result<()> {
    let tmp = fresh(path)?;
    let state = State {
        tensors: src.read(items).await?,
        meta: ckpt_core::Value::Null,
    };
    let bytes = crate::torch::write_pt(&state)
        .map_err(|e| Error::InvalidInput(format!("cannot write `{}`: {e}", path.display())))?;
    std::fs::write(&tmp, bytes)?;
    std::fs::rename(&tmp, path)?;
    Ok(())
}

/// Hugging Face's layout in directory `dir`: `model.safetensors`, or numbered
/// files of at most `max` bytes each with `model.safetensors.index.json`; and
/// `config.json` when one is given.
pub(crate) async fn hf_dir(
    src: &Source<'_>,
    items: &[Item],
    dir: &Path,
    max: u64,
    config: Option<&Path>,
) -> Result<Vec<PathBuf>> {
    std::fs::create_dir_all(dir)?;
    let runs = runs(items, max.max(1));
    let n = runs.len();
    let mut files = Vec::new();
    let mut weight_map = Vec::new();
    for (k, run) in runs.iter().enumerate() {
        let name = if n == 1 {
            "model.safetensors".to_owned()
        } else {
            format!("model-{:05}-of-{n:05}.safetensors", k + 1)
        };
        let path = dir.join(&name);
        safetensors_file(src, run, &path).await?;
        weight_map.extend(run.iter().map(|i| (i.out.clone(), name.clone())));
        files.push(path);
    }
    if n > 1 {
        let path = dir.join("model.safetensors.index.json");
        let tmp = fresh(&path)?;
        let total = items.iter().map(|i| i.nbytes).sum();
        let json = crate::safetensors::index::Index::new(total, weight_map)
            .to_json()
            .map_err(|e| Error::Internal(e.to_string()))?;
        std::fs::write(&tmp, json)?;
        std::fs::rename(&tmp, &path)?;
        files.push(path);
    }
    if let Some(config) = config {
        let path = dir.join("config.json");
        let tmp = fresh(&path)?;
        std::fs::copy(config, &tmp)?;
        std::fs::rename(&tmp, &path)?;
        files.push(path);
    }
    Ok(files)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn item(n: u64) -> Item {
        Item {
            src: format!("t{n}"),
            out: format!("t{n}"),
            dtype: DType::U8,
            shape: vec![n],
            sharded: false,
            nbytes: n,
        }
    }

    #[test]
    fn runs_stay_under_the_limit_unless_one_tensor_is_larger() {
        let items: Vec<Item> = [3, 4, 2, 9, 1].into_iter().map(item).collect();
        let sizes: Vec<Vec<u64>> = runs(&items, 6)
            .iter()
            .map(|r| r.iter().map(|i| i.nbytes).collect())
            .collect();
        assert_eq!(sizes, vec![vec![3], vec![4, 2], vec![9], vec![1]]);
        assert_eq!(runs(&items, 100).len(), 1);
        assert!(runs(&[], 6).is_empty());
    }
}
