//! A checkpoint root on a local directory, seen as files: the memory tier's
//! view of the roots it keeps (its own, a peer's replica, a merge).
//!
//! Keys are those of [`crate::layout::paths`], and the key of an object is the
//! path of its file under the root. Here: what is committed and what a
//! checkpoint references; in `writes`: atomic writes (the manifest last),
//! hard-link pins, drops and retention. Every key that comes from outside (a
//! caller, a manifest's body) must be a plain relative path.

use std::collections::{BTreeSet, HashSet};
use std::fs::{self, File};
use std::io::{self, Read};
use std::path::{Path as FsPath, PathBuf};

use object_store::path::Path;

use crate::error::{Error, Result};
use crate::layout::manifest::{check_key, is_hash, Layout, Manifest, MAX_MANIFEST_BYTES};
use crate::layout::paths::{self, MANIFESTS};
use crate::layout::pymeta::{self, Bookkeeping};
use crate::model::CheckpointId;

mod writes;

#[cfg(test)]
mod tests;

/// A checkpoint root on a local directory. Writes stage their bytes under
/// `incoming`, which must be on the same file system (they are renamed into
/// place).
#[derive(Debug, Clone)]
pub struct LocalRoot {
    path: PathBuf,
    incoming: PathBuf,
}

/// The id of `(step, attempt)`, refused unless the attempt is one a
/// checkpoint name can hold (ASCII letters and digits).
pub fn checkpoint_id(step: u64, attempt: &str) -> Result<CheckpointId> {
    let id = CheckpointId {
        step,
        attempt: attempt.to_owned(),
    };
    paths::parse_checkpoint_name(&paths::checkpoint_name(&id))
        .ok_or_else(|| Error::InvalidInput(format!("bad attempt id `{attempt}`")))
}

/// The key of a checkpoint's manifest.
pub fn manifest_key(id: &CheckpointId) -> String {
    paths::manifest_key(id).to_string()
}

/// The objects a manifest references: the chunks of chunked tensors with
/// their stored lengths, then the per-checkpoint objects it lists (their
/// lengths unrecorded), each once. A key that is not a plain relative path is
/// [`Error::Corrupt`].
pub fn references(m: &Manifest) -> Result<Vec<(String, Option<u64>)>> {
    let object = manifest_key(&m.id());
    let mut seen = HashSet::new();
    let mut out = Vec::new();
    for t in &m.tensors {
        let Layout::Chunks { chunks } = &t.layout else {
            continue;
        };
        for c in chunks {
            if !is_hash(&c.hash) {
                return Err(Error::corrupt(&object, Some(&t.name), "bad chunk hash"));
            }
            let key = paths::chunk_key(&c.hash).to_string();
            if seen.insert(key.clone()) {
                out.push((key, Some(c.stored)));
            }
        }
    }
    for key in &m.objects {
        check_key(key).map_err(|reason| Error::corrupt(&object, None, reason))?;
        if seen.insert(key.clone()) {
            out.push((key.clone(), None));
        }
    }
    Ok(out)
}

/// An I/O failure on `key`: [`Error::NotFound`] when the file is not there,
/// else a storage error that keeps the operating system's error number.
pub(crate) fn io_error(key: &str, doing: &str, e: io::Error) -> Error {
    if e.kind() == io::ErrorKind::NotFound {
        return Error::NotFound {
            what: format!("object `{key}`"),
        };
    }
    Error::Storage(object_store::Error::Generic {
        store: "local root",
        source: Box::new(KeyError {
            what: format!("{doing} `{key}`"),
            source: e,
        }),
    })
}

/// What failed, over the I/O error (whose error number stays reachable).
#[derive(Debug, thiserror::Error)]
#[error("{what}: {source}")]
struct KeyError {
    what: String,
    source: io::Error,
}

impl LocalRoot {
    /// The root at `path` (made absolute, and created if missing).
    pub fn open(path: impl AsRef<FsPath>, incoming: impl AsRef<FsPath>) -> Result<Self> {
        let abs = |p: &FsPath| {
            std::path::absolute(p).map_err(|e| io_error(&p.to_string_lossy(), "resolving", e))
        };
        let root = LocalRoot {
            path: abs(path.as_ref())?,
            incoming: abs(incoming.as_ref())?,
        };
        fs::create_dir_all(&root.path)
            .map_err(|e| io_error(&root.path.to_string_lossy(), "creating", e))?;
        Ok(root)
    }

    /// The root's directory.
    pub fn path(&self) -> &FsPath {
        &self.path
    }

    /// Where writes stage their bytes.
    pub fn incoming(&self) -> &FsPath {
        &self.incoming
    }

    /// The root as a store URL (`file://...`).
    pub fn url(&self) -> Result<String> {
        url::Url::from_file_path(&self.path)
            .map(String::from)
            .map_err(|()| Error::InvalidInput(format!("`{}` has no file URL", self.path.display())))
    }

    /// The file of `key`, refused unless the key is a plain relative path.
    pub(crate) fn file(&self, key: &str) -> Result<PathBuf> {
        check_key(key).map_err(Error::InvalidInput)?;
        Ok(self.path.join(key))
    }

    /// Every committed checkpoint (its manifest is there), oldest first: the
    /// names [`paths::parse_checkpoint_name`] reads; other files are skipped.
    pub fn committed(&self) -> Result<Vec<CheckpointId>> {
        let entries = match fs::read_dir(self.path.join(MANIFESTS)) {
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
            r => r.map_err(|e| io_error(MANIFESTS, "listing", e))?,
        };
        let mut ids = BTreeSet::new();
        for entry in entries {
            let entry = entry.map_err(|e| io_error(MANIFESTS, "listing", e))?;
            let Some(name) = entry.file_name().to_str().map(str::to_owned) else {
                continue;
            };
            if let Some(id) = paths::parse_manifest_key(&Path::from(MANIFESTS).join(name.as_str()))
            {
                ids.insert(id);
            }
        }
        Ok(ids.into_iter().collect())
    }

    /// The manifest of `id`, unverified (see [`unverified`]).
    pub fn manifest(&self, id: &CheckpointId) -> Result<Manifest> {
        let key = manifest_key(id);
        let mut raw = Vec::new();
        File::open(self.file(&key)?)
            .and_then(|f| f.take(MAX_MANIFEST_BYTES as u64 + 1).read_to_end(&mut raw))
            .map_err(|e| io_error(&key, "reading", e))?;
        let m = Manifest::decode_unverified(&raw, &key)?;
        if m.id() != *id {
            return Err(Error::corrupt(
                &key,
                None,
                format!("manifest is for {}, not {id}", m.id()),
            ));
        }
        Ok(m)
    }

    /// Every object of checkpoint `id` with its stored length, the manifest
    /// last. An object that is not there is [`Error::NotFound`].
    pub fn objects(&self, id: &CheckpointId) -> Result<Vec<(String, u64)>> {
        let mut keys: Vec<String> = references(&self.manifest(id)?)?
            .into_iter()
            .map(|(k, _)| k)
            .collect();
        keys.push(manifest_key(id));
        keys.into_iter()
            .map(|k| {
                let len = fs::metadata(self.file(&k)?)
                    .map_err(|e| io_error(&k, "reading", e))?
                    .len();
                Ok((k, len))
            })
            .collect()
    }

    /// Which rank of how many saved checkpoint `id`, as the memory tier's
    /// saves record it in the package's bookkeeping ([`pymeta`]); `None` when
    /// the manifest cannot be read or does not say.
    pub fn identity(&self, id: &CheckpointId) -> Option<(u64, u64)> {
        let m = self.manifest(id).ok()?;
        let info = Bookkeeping::from_value(m.meta.get(pymeta::INFO_KEY)?).ok()?;
        info.memory.filter(|(rank, ranks)| rank < ranks)
    }

    /// The stored length of `key`; `None` when it is not there (or cannot be seen).
    pub fn size(&self, key: &str) -> Result<Option<u64>> {
        let file = self.file(key)?;
        Ok(fs::metadata(file)
            .ok()
            .filter(|m| m.is_file())
            .map(|m| m.len()))
    }

    /// True when `key` is there with `len` bytes.
    pub fn has(&self, key: &str, len: u64) -> Result<bool> {
        Ok(self.size(key)? == Some(len))
    }

    /// The bytes of `key`; `None` when it is gone or unreadable (a peer it is
    /// sent to then sees the wrong length).
    pub fn read(&self, key: &str) -> Result<Option<Vec<u8>>> {
        Ok(fs::read(self.file(key)?).ok())
    }

    /// Fill `out` with the bytes of `key`; false (and `out` in any state) when
    /// the object is gone, unreadable or not `out.len()` bytes long.
    pub fn read_into(&self, key: &str, out: &mut [u8]) -> Result<bool> {
        let file = self.file(key)?;
        let mut read = |f: &mut File| -> io::Result<bool> {
            if f.metadata()?.len() != out.len() as u64 {
                return Ok(false);
            }
            f.read_exact(out)?;
            Ok(true)
        };
        Ok(File::open(file)
            .and_then(|mut f| read(&mut f))
            .unwrap_or(false))
    }
}
