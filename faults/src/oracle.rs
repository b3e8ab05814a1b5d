//! What a restart must find: the committed checkpoints under a root and which of
//! them are intact, checked straight on disk.
//!
//! The engine's listing defines what is committed (a manifest under `manifests/`);
//! intactness is checked here without the engine's load path: the manifest must
//! parse (header hash and records), and every chunk it names must be a file whose
//! decoded bytes hash to its name. `load_latest` must then resume from the newest
//! intact checkpoint and skip exactly the damaged ones newer than it.
//!
//! Writer epochs are judged here too, from the claim files themselves: a
//! manifest whose epoch is older than the newest claim and that the claim does
//! not list was committed by a zombie incarnation, and is not a checkpoint.

use std::collections::BTreeSet;
use std::path::Path;

use bytes::Bytes;
use ckpt_core::{CheckpointId, Layout};

/// One committed checkpoint.
#[derive(Debug, Clone)]
pub struct Committed {
    /// Which.
    pub id: CheckpointId,
    /// Its manifest's key.
    pub manifest_key: String,
    /// Keys of every object it needs (its manifest included).
    pub objects: BTreeSet<String>,
    /// Why it is damaged, if it is.
    pub damage: Option<String>,
}

/// The committed checkpoints under a root, oldest first.
#[derive(Debug, Clone, Default)]
pub struct Scan {
    /// The checkpoints.
    pub committed: Vec<Committed>,
    /// Manifests a fenced writer (a zombie) committed: stored, never to be loaded.
    pub zombies: Vec<CheckpointId>,
}

impl Scan {
    /// The newest intact checkpoint.
    pub fn newest_intact(&self) -> Option<&Committed> {
        self.committed.iter().rev().find(|c| c.damage.is_none())
    }

    /// The damaged checkpoints newer than the newest intact one (all damaged ones if
    /// none is intact): what `load_latest` must skip, newest first.
    pub fn must_skip(&self) -> Vec<CheckpointId> {
        self.committed
            .iter()
            .rev()
            .take_while(|c| c.damage.is_some())
            .map(|c| c.id.clone())
            .collect()
    }

    /// The newest committed checkpoint, intact or not.
    pub fn newest(&self) -> Option<&Committed> {
        self.committed.last()
    }

    /// Ids of every committed checkpoint.
    pub fn ids(&self) -> BTreeSet<CheckpointId> {
        self.committed.iter().map(|c| c.id.clone()).collect()
    }
}

/// Scan the checkpoint root at `root` (a local directory).
pub async fn scan(root: &Path) -> ckpt_core::Result<Scan> {
    let cp = ckpt_formats::builder(format!("file://{}", root.display()))
        .read_only()
        .build()
        .await?;
    let mut out = Scan::default();
    let (current, listed) = newest_claim(root);
    for id in ckpt_core::layout::committed(cp.store().as_ref()).await? {
        let manifest_key = ckpt_core::layout::manifest_key(&id).to_string();
        let mut objects = BTreeSet::from([manifest_key.clone()]);
        let damage = match cp.manifest(&id).await {
            Err(e) => Some(format!("manifest: {e}")),
            Ok(m)
                if m.epoch < current
                    && listed
                        .as_ref()
                        .is_some_and(|l| !l.contains(&ckpt_core::layout::checkpoint_name(&id))) =>
            {
                out.zombies.push(id);
                continue;
            }
            Ok(m) => {
                let mut damage = None;
                for obj in &m.objects {
                    objects.insert(obj.clone());
                    if damage.is_none() && !root.join(obj).is_file() {
                        damage = Some(format!("object `{obj}` is missing"));
                    }
                }
                let mut other_layout = false;
                for t in &m.tensors {
                    match &t.layout {
                        Layout::Chunks { chunks } => {
                            for c in chunks {
                                let key = format!("{}/{}", ckpt_core::layout::CHUNKS, c.hash);
                                if damage.is_none() {
                                    // A packed chunk holds more than this tensor's slice.
                                    let cap = if c.offset.is_some() {
                                        ckpt_core::MAX_CHUNK_BYTES as u64
                                    } else {
                                        c.len
                                    };
                                    damage = check_chunk(&root.join(&key), &c.hash, cap)
                                        .map(|why| format!("`{key}`: {why}"));
                                }
                                objects.insert(key);
                            }
                        }
                        Layout::Range { object, .. } => {
                            objects.insert(object.clone());
                            other_layout = true;
                        }
                    }
                }
                if damage.is_none() && other_layout {
                    damage = cp.verify(&id).await.err().map(|e| e.to_string());
                }
                damage
            }
        };
        out.committed.push(Committed {
            id,
            manifest_key,
            objects,
            damage,
        });
    }
    Ok(out)
}

/// The newest epoch claimed under a root (0: none) and the checkpoint names
/// its claim lists, read from the claim files (`None`: no claim, or a damaged
/// one, which says nothing: every committed checkpoint counts).
fn newest_claim(root: &Path) -> (u64, Option<BTreeSet<String>>) {
    let newest = std::fs::read_dir(root.join("epochs"))
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let name = e.file_name().into_string().ok()?;
            let n: u64 = name.strip_suffix(".claim")?.parse().ok()?;
            Some((n, e.path()))
        })
        .max();
    let Some((n, path)) = newest else {
        return (0, None);
    };
    let listed = std::fs::read(path)
        .ok()
        .and_then(|b| serde_json::from_slice::<serde_json::Value>(&b).ok())
        .and_then(|v| {
            v.get("valid")?.as_array().map(|a| {
                a.iter()
                    .filter_map(|s| s.as_str().map(str::to_owned))
                    .collect()
            })
        });
    (n, listed)
}

/// Why a stored chunk is not the chunk `hash`, or `None` when it is.
fn check_chunk(path: &Path, hash: &str, raw_len: u64) -> Option<String> {
    match std::fs::read(path) {
        Err(e) => Some(format!("unreadable: {e}")),
        Ok(bytes) => {
            ckpt_formats::native::chunk::decode(Bytes::from(bytes), hash, raw_len as usize)
                .err()
                .map(|e| e.to_string())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ckpt_core::{State, Tensor};

    #[tokio::test]
    async fn a_flipped_chunk_damages_every_checkpoint_that_shares_it() {
        let dir = tempfile::tempdir().unwrap();
        let cp = ckpt_formats::builder(format!("file://{}", dir.path().display()))
            .build()
            .await
            .unwrap();
        // Large enough to be a chunk of its own rather than packed with `w`.
        let frozen = Tensor::from_f32("frozen", vec![1 << 20], &vec![1.5; 1 << 20]).unwrap();
        for step in [1, 2] {
            let s = State::new()
                .with_tensor(frozen.clone())
                .with_tensor(Tensor::from_f32("w", vec![1], &[step as f32]).unwrap());
            cp.save(step, &s).await.unwrap().wait().await.unwrap();
        }
        let s = scan(dir.path()).await.unwrap();
        assert_eq!(s.committed.len(), 2);
        assert_eq!(s.newest_intact().unwrap().id.step, 2);
        assert!(s.must_skip().is_empty());
        // The chunk both checkpoints share.
        let shared: Vec<&String> = s.committed[0]
            .objects
            .intersection(&s.committed[1].objects)
            .collect();
        assert_eq!(shared.len(), 1, "{shared:?}");
        let path = dir.path().join(shared[0]);
        let mut b = std::fs::read(&path).unwrap();
        let last = b.len() - 1;
        b[last] ^= 1;
        std::fs::write(&path, b).unwrap();
        let s = scan(dir.path()).await.unwrap();
        assert!(s.newest_intact().is_none());
        assert_eq!(s.must_skip().len(), 2);
        // The engine agrees.
        let l = cp.load_latest().await.unwrap();
        assert!(l.is_none());
    }
}
