//! A fragment: one rank's records of a checkpoint, written beside its data.
//!
//! In a job of several ranks each rank writes the records of what it stored
//! as `data/<checkpoint>/records/<rank:06>.frag`, in parallel with the others,
//! and sends rank 0 only its [`FragmentRef`] (hash and length). Rank 0 lists
//! them in the root manifest, which is published last: a fragment without a
//! root is not a checkpoint, and GC removes it with the rest of its `data/`.
//!
//! Stored as the manifest is, a header line and a JSON body:
//!
//! ```text
//! ckpt-fragment 1 <blake3 of body, hex> <body length>\n
//! { ...json... }
//! ```
//!
//! A fragment is read only through its reference in a root, whose hash must
//! match the whole stored form: a fragment that is missing, truncated or
//! altered makes its checkpoint damaged, never partly loaded. The decoder is
//! pure and capped at [`MAX_FRAGMENT_BYTES`].

use object_store::path::Path;
use object_store::{ObjectStore, ObjectStoreExt};
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::layout::manifest::{is_hash, validate_records, TensorRecord, MAX_MANIFEST_BYTES};
use crate::layout::paths;
use crate::model::CheckpointId;

/// Schema version of fragments written by this library.
pub const FRAGMENT_VERSION: u32 = 1;
/// Largest fragment the decoder accepts (one rank's records).
pub const MAX_FRAGMENT_BYTES: usize = MAX_MANIFEST_BYTES;
const MAGIC: &str = "ckpt-fragment";

/// What a root knows of one rank's fragment.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FragmentRef {
    /// The rank that wrote it (its key follows from it: [`fragment_key`]).
    pub rank: u32,
    /// blake3 of the whole stored form, hex.
    pub blake3: String,
    /// Length of the stored form.
    pub len: u64,
}

/// One rank's records of a checkpoint.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Fragment {
    /// Schema version ([`FRAGMENT_VERSION`]).
    pub version: u32,
    /// The checkpoint's step.
    pub step: u64,
    /// The checkpoint's attempt.
    pub attempt: String,
    /// The rank that wrote it.
    pub rank: u32,
    /// Records of the tensors this rank stored.
    pub tensors: Vec<TensorRecord>,
    /// This rank's per-checkpoint objects (single-file formats), relative to the root.
    #[serde(default)]
    pub objects: Vec<String>,
}

/// Key of rank `rank`'s fragment of checkpoint `id`.
pub fn fragment_key(id: &CheckpointId, rank: u32) -> Path {
    paths::data_prefix(id)
        .clone()
        .join("records")
        .join(format!("{rank:06}.frag"))
}

impl Fragment {
    /// The checkpoint this fragment belongs to.
    pub fn id(&self) -> CheckpointId {
        CheckpointId {
            step: self.step,
            attempt: self.attempt.clone(),
        }
    }

    /// Encode to the stored form.
    pub fn encode(&self) -> Result<Vec<u8>> {
        validate_records(&self.tensors, &self.objects)?;
        let body = serde_json::to_vec(self)
            .map_err(|e| Error::Internal(format!("encode fragment: {e}")))?;
        let mut out = format!(
            "{MAGIC} {FRAGMENT_VERSION} {} {}\n",
            blake3::hash(&body).to_hex(),
            body.len()
        )
        .into_bytes();
        out.extend_from_slice(&body);
        Ok(out)
    }

    /// Decode and validate the stored form; `object` names it in errors.
    pub fn decode(bytes: &[u8], object: &str) -> Result<Fragment> {
        let bad = |reason: String| Error::corrupt(object, None, reason);
        if bytes.len() > MAX_FRAGMENT_BYTES {
            return Err(bad(format!(
                "fragment of {} bytes exceeds the cap",
                bytes.len()
            )));
        }
        let nl = bytes
            .iter()
            .take(256)
            .position(|&b| b == b'\n')
            .ok_or_else(|| bad("no fragment header".into()))?;
        let header =
            std::str::from_utf8(&bytes[..nl]).map_err(|_| bad("header is not UTF-8".into()))?;
        let fields: Vec<&str> = header.split(' ').collect();
        let [magic, version, hash, len] = fields[..] else {
            return Err(bad("bad fragment header".into()));
        };
        let body = &bytes[nl + 1..];
        if magic != MAGIC || len.parse::<usize>().ok() != Some(body.len()) {
            return Err(bad("not a ckpt fragment, or truncated".into()));
        }
        if blake3::hash(body).to_hex().as_str() != hash {
            return Err(bad("fragment hash mismatch".into()));
        }
        let f: Fragment = serde_json::from_slice(body)
            .map_err(|e| bad(format!("fragment does not parse: {e}")))?;
        if version != FRAGMENT_VERSION.to_string() || f.version != FRAGMENT_VERSION {
            return Err(Error::Unsupported(format!(
                "fragment `{object}` has schema version {}; this library reads {FRAGMENT_VERSION}",
                f.version
            )));
        }
        validate_records(&f.tensors, &f.objects).map_err(|e| match e {
            Error::InvalidInput(reason) => bad(reason),
            other => other,
        })?;
        Ok(f)
    }
}

/// Write a fragment; returns the reference the root keeps of it.
pub async fn put(store: &dyn ObjectStore, fragment: &Fragment) -> Result<FragmentRef> {
    let bytes = fragment.encode()?;
    let fref = FragmentRef {
        rank: fragment.rank,
        blake3: blake3::hash(&bytes).to_hex().to_string(),
        len: bytes.len() as u64,
    };
    store
        .put(
            &fragment_key(&fragment.id(), fragment.rank),
            bytes::Bytes::from(bytes).into(),
        )
        .await?;
    Ok(fref)
}

/// Read the fragment a root references, checked against the reference: its
/// length (before the body is read), its hash, its checkpoint and rank.
pub async fn read(
    store: &dyn ObjectStore,
    id: &CheckpointId,
    fref: &FragmentRef,
) -> Result<Fragment> {
    let key = fragment_key(id, fref.rank);
    let missing = |e: object_store::Error| match e {
        object_store::Error::NotFound { .. } => Error::corrupt(
            key.as_ref(),
            None,
            format!("rank {}'s fragment of {id} is missing", fref.rank),
        ),
        e => e.into(),
    };
    let r = store.get(&key).await.map_err(missing)?;
    if r.meta.size != fref.len {
        return Err(Error::corrupt(
            key.as_ref(),
            None,
            format!(
                "fragment is {} bytes, the root says {}",
                r.meta.size, fref.len
            ),
        ));
    }
    let bytes = r.bytes().await.map_err(missing)?;
    if blake3::hash(&bytes).to_hex().as_str() != fref.blake3 {
        return Err(Error::corrupt(
            key.as_ref(),
            None,
            "fragment does not match the root's hash of it",
        ));
    }
    let f = Fragment::decode(&bytes, key.as_ref())?;
    if f.id() != *id || f.rank != fref.rank {
        return Err(Error::corrupt(
            key.as_ref(),
            None,
            format!(
                "fragment is rank {}'s of {}, not rank {}'s of {id}",
                f.rank,
                f.id(),
                fref.rank
            ),
        ));
    }
    Ok(f)
}

/// Check a root's fragment references: one per rank at most, ranks within
/// the job, hashes well formed.
pub(crate) fn validate_refs(
    refs: &[FragmentRef],
    world_size: u32,
) -> std::result::Result<(), String> {
    let mut last = None;
    for f in refs {
        if f.rank >= world_size || last.is_some_and(|l| f.rank <= l) {
            return Err(format!(
                "fragment of rank {} out of order or outside a job of {world_size}",
                f.rank
            ));
        }
        if !is_hash(&f.blake3) || f.len > MAX_FRAGMENT_BYTES as u64 {
            return Err(format!("fragment of rank {}: bad hash or length", f.rank));
        }
        last = Some(f.rank);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::manifest::{ChunkRef, Layout};
    use crate::model::dtype::DType;

    fn sample() -> Fragment {
        Fragment {
            version: FRAGMENT_VERSION,
            step: 3,
            attempt: "ab".into(),
            rank: 5,
            tensors: vec![TensorRecord {
                name: "w".into(),
                dtype: DType::F32,
                shape: vec![2],
                shard: None,
                layout: Layout::Chunks {
                    chunks: vec![ChunkRef {
                        hash: "b".repeat(64),
                        len: 8,
                        stored: 72,
                        offset: None,
                    }],
                },
            }],
            objects: vec![],
        }
    }

    #[test]
    fn round_trip_and_every_flip_or_cut_is_damage() {
        let f = sample();
        let bytes = f.encode().unwrap();
        assert_eq!(Fragment::decode(&bytes, "f").unwrap(), f);
        for i in 0..bytes.len() {
            let mut b = bytes.clone();
            b[i] ^= 1;
            match Fragment::decode(&b, "f") {
                Err(e) => assert!(
                    e.is_damage() || matches!(e, Error::Unsupported(_)),
                    "{i}: {e}"
                ),
                Ok(_) => panic!("flip at {i} not detected"),
            }
        }
        for cut in 0..bytes.len() {
            assert!(Fragment::decode(&bytes[..cut], "f").is_err());
        }
    }

    #[tokio::test]
    async fn a_fragment_is_read_only_as_its_reference_says() {
        let store = object_store::memory::InMemory::new();
        let f = sample();
        let fref = put(&store, &f).await.unwrap();
        let id = f.id();
        assert_eq!(read(&store, &id, &fref).await.unwrap(), f);
        // Another rank's reference, a wrong hash, a wrong length: damage.
        let wrong = FragmentRef {
            blake3: "c".repeat(64),
            ..fref.clone()
        };
        assert!(read(&store, &id, &wrong).await.unwrap_err().is_damage());
        let short = FragmentRef {
            len: fref.len - 1,
            ..fref.clone()
        };
        assert!(read(&store, &id, &short).await.unwrap_err().is_damage());
        let other = FragmentRef { rank: 6, ..fref };
        let e = read(&store, &id, &other).await.unwrap_err();
        assert!(e.is_damage(), "{e}");
        assert!(e.to_string().contains("missing"), "{e}");
    }

    #[test]
    fn references_are_checked() {
        let r = |rank| FragmentRef {
            rank,
            blake3: "a".repeat(64),
            len: 10,
        };
        assert!(validate_refs(&[r(0), r(1)], 2).is_ok());
        assert!(validate_refs(&[r(1), r(0)], 2).is_err());
        assert!(validate_refs(&[r(0), r(2)], 2).is_err());
        assert!(validate_refs(&[r(0), r(0)], 2).is_err());
    }
}
