//! Where things live under a checkpoint root.
//!
//! ```text
//! chunks/<blake3 hex>                  content-addressed chunks, shared by all checkpoints
//! data/<step:020>-<attempt>/...        per-checkpoint objects (non-chunked formats, rank files)
//! manifests/<step:020>-<attempt>.manifest   the commit record: a checkpoint exists iff this does
//! attendance/<job nonce>/<rank>        a rank waiting long in a collective (coord::RollCall)
//! ```

use object_store::path::Path;

use crate::model::CheckpointId;

/// Folder of content-addressed chunks.
pub const CHUNKS: &str = "chunks";
/// Folder of per-checkpoint data.
pub const DATA: &str = "data";
/// Folder of manifests (commit records).
pub const MANIFESTS: &str = "manifests";
const MANIFEST_EXT: &str = ".manifest";

/// Folder of collective attendance marks ([`crate::coord::RollCall`]).
pub const ATTENDANCE: &str = "attendance";

/// Prefix of the attendance marks of the job that agreed on `nonce`.
pub fn attendance_prefix(nonce: &str) -> Path {
    Path::from(format!("{ATTENDANCE}/{nonce}"))
}

/// Key of `rank`'s attendance mark in the job that agreed on `nonce`.
pub fn attendance_key(nonce: &str, rank: usize) -> Path {
    Path::from(format!("{ATTENDANCE}/{nonce}/{rank}"))
}

/// The rank an attendance mark is for.
pub fn parse_attendance_key(key: &Path) -> Option<usize> {
    let mut parts = key.parts();
    if parts.next()?.as_ref() != ATTENDANCE {
        return None;
    }
    parts.next()?;
    let rank = parts.next()?.as_ref().parse().ok()?;
    parts.next().is_none().then_some(rank)
}

/// Key of a chunk named by its blake3 hash (hex).
pub fn chunk_key(hash_hex: &str) -> Path {
    Path::from(format!("{CHUNKS}/{hash_hex}"))
}

/// Name of a checkpoint: zero-padded step so that names sort by step.
pub fn checkpoint_name(id: &CheckpointId) -> String {
    format!("{:020}-{}", id.step, id.attempt)
}

/// Prefix of a checkpoint's own data objects.
pub fn data_prefix(id: &CheckpointId) -> Path {
    Path::from(format!("{DATA}/{}", checkpoint_name(id)))
}

/// Key of a checkpoint's manifest.
pub fn manifest_key(id: &CheckpointId) -> Path {
    Path::from(format!("{MANIFESTS}/{}{MANIFEST_EXT}", checkpoint_name(id)))
}

/// Parse `<step>-<attempt>` back into an id.
pub fn parse_checkpoint_name(name: &str) -> Option<CheckpointId> {
    let (step, attempt) = name.split_once('-')?;
    if step.len() != 20 || attempt.is_empty() || !attempt.bytes().all(|b| b.is_ascii_alphanumeric())
    {
        return None;
    }
    Some(CheckpointId {
        step: step.parse().ok()?,
        attempt: attempt.to_owned(),
    })
}

/// Parse a manifest key (`manifests/<name>.manifest`) into an id.
pub fn parse_manifest_key(key: &Path) -> Option<CheckpointId> {
    let name = key.filename()?.strip_suffix(MANIFEST_EXT)?;
    parse_checkpoint_name(name)
}

/// Parse a data key (`data/<name>/...`) into the id of the checkpoint it belongs to.
pub fn parse_data_key(key: &Path) -> Option<CheckpointId> {
    let mut parts = key.parts();
    if parts.next()?.as_ref() != DATA {
        return None;
    }
    parse_checkpoint_name(parts.next()?.as_ref())
}

/// A fresh random attempt id (16 hex digits).
pub fn new_attempt_id() -> String {
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::time::{SystemTime, UNIX_EPOCH};
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let mut h = blake3::Hasher::new();
    h.update(&std::process::id().to_le_bytes());
    h.update(&COUNTER.fetch_add(1, Ordering::Relaxed).to_le_bytes());
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default();
    h.update(&now.as_nanos().to_le_bytes());
    let addr = &h as *const _ as usize;
    h.update(&addr.to_le_bytes());
    h.finalize().to_hex()[..16].to_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_sort() {
        let a = CheckpointId {
            step: 9,
            attempt: "ab12".into(),
        };
        let b = CheckpointId {
            step: 10,
            attempt: "00".into(),
        };
        assert_eq!(parse_manifest_key(&manifest_key(&a)), Some(a.clone()));
        assert_eq!(
            parse_data_key(&data_prefix(&b).clone().join("rank0")),
            Some(b.clone())
        );
        assert!(checkpoint_name(&a) < checkpoint_name(&b));
        assert_eq!(parse_checkpoint_name("12-ab"), None);
        assert_eq!(parse_checkpoint_name("00000000000000000012-a/b"), None);
        assert_ne!(new_attempt_id(), new_attempt_id());
        assert_eq!(parse_attendance_key(&attendance_key("n0", 17)), Some(17));
        assert_eq!(parse_attendance_key(&Path::from("attendance/n0/x")), None);
        assert_eq!(parse_attendance_key(&Path::from("chunks/n0/1")), None);
    }
}
