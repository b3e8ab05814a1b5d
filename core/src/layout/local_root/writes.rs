//! What changes a local root: atomic writes (a staged file fsynced and renamed
//! into place, then its directory fsynced, as the engine's local writes do),
//! a manifest written last, hard-link pins, drops and retention.

use std::collections::HashSet;
use std::fs::{self, File};
use std::io::Write;
use std::path::Path as FsPath;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::checkpointer::CheckpointerOptions;
use crate::error::{Error, Result};
use crate::layout::chunks::ChunkIndex;
use crate::layout::manifest::Manifest;
use crate::layout::paths::MANIFESTS;
use crate::layout::retention::{self, GcReport, Retention, Sweep};
use crate::model::CheckpointId;

use super::{io_error, manifest_key, references, LocalRoot};

impl LocalRoot {
    /// Write `key` whole or not at all.
    pub fn write(&self, key: &str, data: &[u8]) -> Result<()> {
        let dst = self.file(key)?;
        self.place(key, &dst, |tmp| {
            let mut f = File::create(tmp)?;
            f.write_all(data)?;
            f.sync_all()
        })
    }

    /// Write a manifest (stored form, verified first) under its own key: the
    /// commit of its checkpoint, so the caller writes it after every object
    /// it references. Returns the checkpoint it commits.
    pub fn write_manifest(&self, raw: &[u8]) -> Result<CheckpointId> {
        let id = Manifest::decode(raw, "manifest to write")?.id();
        self.write(&manifest_key(&id), raw)?;
        Ok(id)
    }

    /// Make `key` of `from` an object of this root too: a hard link, or a copy
    /// where the two cannot share the file.
    pub fn link_from(&self, from: &LocalRoot, key: &str) -> Result<()> {
        let (src, dst) = (from.file(key)?, self.file(key)?);
        if let Some(dir) = dst.parent() {
            fs::create_dir_all(dir).map_err(|e| io_error(key, "writing", e))?;
        }
        if fs::hard_link(&src, &dst).is_ok() {
            return Ok(());
        }
        self.place(key, &dst, |tmp| {
            fs::copy(&src, tmp)?;
            File::open(tmp)?.sync_all()
        })
    }

    /// Stage `key`'s bytes with `fill` under `incoming`, and rename them to `dst`.
    fn place(
        &self,
        key: &str,
        dst: &FsPath,
        fill: impl FnOnce(&FsPath) -> std::io::Result<()>,
    ) -> Result<()> {
        static COUNTER: AtomicU64 = AtomicU64::new(0);
        let err = |e| io_error(key, "writing", e);
        fs::create_dir_all(&self.incoming).map_err(err)?;
        let n = COUNTER.fetch_add(1, Ordering::Relaxed);
        let tmp = self.incoming.join(format!("{}-{n}", std::process::id()));
        let done = fill(&tmp).and_then(|()| {
            let dir = dst.parent().unwrap_or(&self.path);
            fs::create_dir_all(dir)?;
            fs::rename(&tmp, dst)?;
            File::open(dir)?.sync_all()
        });
        if done.is_err() {
            let _ = fs::remove_file(&tmp);
        }
        done.map_err(err)
    }

    /// Hard-link every object of checkpoint `id` under `into` (same keys; what
    /// was there is removed first), so that retention here cannot remove
    /// what a copy elsewhere still reads. Its objects there, as
    /// [`LocalRoot::objects`] lists them; `None` when the checkpoint is gone
    /// (retired meanwhile), and then `into` is removed.
    pub fn pin(&self, id: &CheckpointId, into: &FsPath) -> Result<Option<Vec<(String, u64)>>> {
        let _ = fs::remove_dir_all(into);
        let pinned = LocalRoot::open(into, &self.incoming)?;
        let link = |key: &str| -> Result<()> {
            let dst = pinned.file(key)?;
            if let Some(dir) = dst.parent() {
                fs::create_dir_all(dir).map_err(|e| io_error(key, "pinning", e))?;
            }
            fs::hard_link(self.file(key)?, &dst).map_err(|e| io_error(key, "pinning", e))
        };
        let linked = (|| {
            fs::create_dir_all(into.join(MANIFESTS))
                .map_err(|e| io_error(MANIFESTS, "pinning", e))?;
            // The manifest first: the rest exists while it does.
            link(&manifest_key(id))?;
            for (key, _) in references(&pinned.manifest(id)?)? {
                link(&key)?;
            }
            pinned.objects(id)
        })();
        match linked {
            Ok(objects) => Ok(Some(objects)),
            Err(e) => {
                let _ = fs::remove_dir_all(into);
                match e {
                    Error::NotFound { .. } => Ok(None),
                    e => Err(e),
                }
            }
        }
    }

    /// Uncommit checkpoint `id` (its manifest goes; retention collects the rest).
    pub fn drop_checkpoint(&self, id: &CheckpointId) -> Result<()> {
        let key = manifest_key(id);
        match fs::remove_file(self.file(&key)?) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                Err(io_error(&key, "deleting", e))
            }
            _ => Ok(()),
        }
    }

    /// Uncommit every checkpoint newer than `step`.
    pub fn drop_newer(&self, step: u64) -> Result<()> {
        for id in self.committed()?.into_iter().filter(|id| id.step > step) {
            self.drop_checkpoint(&id)?;
        }
        Ok(())
    }

    /// Retention by the engine's own GC, as a checkpointer of this root with
    /// `keep_last` and no fencing would run it: the newest `keep_last`
    /// committed checkpoints stay, with what they reference; chunks and data
    /// of incomplete saves younger than the default grace period stay too.
    pub async fn retain(&self, keep_last: usize) -> Result<GcReport> {
        let store = crate::store::open_dir(&self.path)?;
        let mut sweep = Sweep {
            grace: CheckpointerOptions::default().gc_grace,
            ..Sweep::default()
        };
        retention::collect(
            store.as_ref(),
            &Retention::keep_last(keep_last),
            &ChunkIndex::new(),
            &HashSet::new(),
            &mut sweep,
        )
        .await
    }
}
