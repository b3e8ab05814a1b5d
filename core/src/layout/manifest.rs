//! The manifest: the commit record of a checkpoint.
//!
//! Stored as one header line and a JSON body:
//!
//! ```text
//! ckpt-manifest <version> <blake3 of body, hex> <body length>\n
//! { ...json... }
//! ```
//!
//! Version 1 holds every tensor record itself (a job of one rank, and every
//! checkpoint written before version 2). Version 2 is the root of a job of
//! several ranks: each rank's records are a fragment of its own
//! ([`crate::layout::fragment`]), and the root holds only what every loader
//! needs to find them, O(ranks + tensors): each fragment's hash and length, and
//! an index of the tensors and where their pieces are ([`crate::layout::index`]).
//!
//! The decoder is pure, refuses anything over [`MAX_MANIFEST_BYTES`], verifies the
//! body hash before parsing, and then checks that every record is consistent
//! (sizes agree with dtype and shape, keys are relative, names are unique), all
//! with checked arithmetic.

use std::collections::{HashMap, HashSet};

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::layout::fragment::FragmentRef;
use crate::layout::index::{self, IndexEntry};
use crate::model::dtype::DType;
use crate::model::tensor::{numel, ShardSpec};
use crate::model::value::Value;
use crate::model::CheckpointId;

/// Newest schema version written by this library: a root with fragments,
/// holding the records of replicated tensors itself.
pub const MANIFEST_VERSION: u32 = 3;
/// The first schema with fragments (every record in one; still read).
pub const MANIFEST_VERSION_FRAGMENTS: u32 = 2;
/// The schema of a manifest that holds every record itself (still written
/// when there are no fragments, so older readers open single-rank checkpoints).
pub const MANIFEST_VERSION_INLINE: u32 = 1;
/// Largest manifest the decoder accepts.
pub const MAX_MANIFEST_BYTES: usize = 256 << 20;
const MAGIC: &str = "ckpt-manifest";

/// One stored piece of a chunked tensor, named by the blake3 hash of its raw bytes.
///
/// A large tensor is split over whole chunks (`offset` is `None`); small tensors
/// are packed together into shared chunks, each referring to its slice
/// `[offset, offset + len)` of the chunk's raw bytes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChunkRef {
    /// blake3 of the chunk's raw (uncompressed) bytes, hex; also the chunk's key.
    pub hash: String,
    /// Bytes of the tensor in this chunk (the whole chunk unless packed).
    pub len: u64,
    /// Length of the stored object (after compression and framing).
    pub stored: u64,
    /// For a packed chunk, where this tensor's bytes start in it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub offset: Option<u64>,
}

/// Where a tensor's bytes are stored.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Layout {
    /// Split into content-addressed chunks, concatenated in order (native format).
    Chunks {
        /// The chunks, in tensor order.
        chunks: Vec<ChunkRef>,
    },
    /// A byte range of one object (safetensors, HDF5, `.pt` files).
    Range {
        /// Key of the object, relative to the checkpoint root.
        object: String,
        /// Offset of the tensor's first byte in the object.
        offset: u64,
        /// Length in bytes.
        len: u64,
        /// blake3 of the tensor's bytes, hex.
        blake3: String,
    },
}

impl Layout {
    /// Raw length of the tensor this layout describes.
    pub fn raw_len(&self) -> Result<u64> {
        match self {
            Layout::Chunks { chunks } => chunks.iter().try_fold(0u64, |acc, c| {
                acc.checked_add(c.len)
                    .ok_or_else(|| Error::corrupt("manifest", None, "chunk lengths overflow"))
            }),
            Layout::Range { len, .. } => Ok(*len),
        }
    }
}

/// One tensor of a checkpoint.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TensorRecord {
    /// Name, unique in the checkpoint.
    pub name: String,
    /// Element type.
    pub dtype: DType,
    /// Local shape.
    pub shape: Vec<u64>,
    /// Placement in a global tensor, if sharded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shard: Option<ShardSpec>,
    /// Where the bytes are.
    pub layout: Layout,
}

impl TensorRecord {
    /// Raw byte length implied by dtype and shape.
    pub fn nbytes(&self) -> Result<u64> {
        self.dtype.byte_len(numel(&self.shape)?)
    }
}

/// The commit record of one checkpoint.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    /// Schema version ([`MANIFEST_VERSION`]).
    pub version: u32,
    /// The library that wrote it, e.g. `ckpt 0.1.0`.
    pub library: String,
    /// Name of the format that laid out the tensors (`native`, `safetensors`, ...).
    pub format: String,
    /// Training step.
    pub step: u64,
    /// Save attempt id.
    pub attempt: String,
    /// Number of ranks that wrote the checkpoint.
    pub world_size: u32,
    /// Wall-clock time of the commit, milliseconds since the Unix epoch.
    pub created_unix_ms: u64,
    /// The writer epoch that committed it (0: written before writer epochs
    /// existed, or by a writer that never claimed one). See [`crate::layout::epoch`].
    #[serde(default)]
    pub epoch: u64,
    /// The tensors.
    pub tensors: Vec<TensorRecord>,
    /// Non-tensor state.
    #[serde(default)]
    pub meta: Value,
    /// Per-checkpoint objects (under `data/`) that belong to this checkpoint,
    /// relative to the root. Content-addressed chunks are not listed here.
    #[serde(default)]
    pub objects: Vec<String>,
    /// Version 2: each rank's fragment of records, in rank order.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub fragments: Vec<FragmentRef>,
    /// Version 2: every tensor, and which fragments hold its pieces.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub index: Vec<IndexEntry>,
}

impl Manifest {
    /// The checkpoint this manifest commits.
    pub fn id(&self) -> CheckpointId {
        CheckpointId {
            step: self.step,
            attempt: self.attempt.clone(),
        }
    }

    /// How many tensors an index entry stands for (an own entry: one per rank).
    fn copies(&self, e: &IndexEntry) -> u64 {
        if e.own {
            u64::from(self.world_size)
        } else {
            1
        }
    }

    /// True for a root whose records are in fragments (version 2).
    pub fn has_fragments(&self) -> bool {
        !self.fragments.is_empty()
    }

    /// Total raw tensor bytes.
    pub fn raw_bytes(&self) -> u64 {
        if self.has_fragments() {
            return self
                .index
                .iter()
                .filter_map(|e| e.nbytes().ok().map(|b| b * self.copies(e)))
                .sum();
        }
        self.tensors
            .iter()
            .filter_map(|t| t.layout.raw_len().ok())
            .sum()
    }

    /// Number of distinct tensors (a sharded one counts once).
    pub fn tensor_count(&self) -> usize {
        if self.has_fragments() {
            return self.index.iter().map(|e| self.copies(e) as usize).sum();
        }
        self.tensors
            .iter()
            .map(|t| t.name.as_str())
            .collect::<HashSet<_>>()
            .len()
    }

    /// Every tensor's name, dtype, global shape and number of stored pieces,
    /// from the records or, in a root, from its index (nothing else read).
    pub fn table(&self) -> Vec<(String, DType, Vec<u64>, usize)> {
        if self.has_fragments() {
            let mut out = Vec::with_capacity(self.index.len());
            for e in &self.index {
                if !e.own {
                    out.push((e.name.clone(), e.dtype, e.shape.clone(), e.piece_count()));
                    continue;
                }
                for r in 0..u64::from(self.world_size) {
                    let name = format!("{}{}", crate::layout::pymeta::own_name(r), e.name);
                    out.push((name, e.dtype, e.shape.clone(), 1));
                }
            }
            return out;
        }
        let mut out: Vec<(String, DType, Vec<u64>, usize)> = Vec::new();
        let mut at: HashMap<&str, usize> = HashMap::new();
        for r in &self.tensors {
            let global = r
                .shard
                .as_ref()
                .map_or_else(|| r.shape.clone(), |s| s.global_shape.clone());
            match at.get(r.name.as_str()) {
                Some(&i) => out[i].3 += 1,
                None => {
                    at.insert(r.name.as_str(), out.len());
                    out.push((r.name.clone(), r.dtype, global, 1));
                }
            }
        }
        out
    }

    /// Distinct chunk hashes this checkpoint references.
    pub fn chunk_hashes(&self) -> impl Iterator<Item = &str> {
        self.tensors.iter().flat_map(|t| match &t.layout {
            Layout::Chunks { chunks } => chunks.iter().map(|c| c.hash.as_str()).collect::<Vec<_>>(),
            Layout::Range { .. } => Vec::new(),
        })
    }

    /// Encode to the stored form.
    pub fn encode(&self) -> Result<Vec<u8>> {
        let body = serde_json::to_vec(self)
            .map_err(|e| Error::Internal(format!("encode manifest: {e}")))?;
        let hash = blake3::hash(&body);
        // The epoch is in the header too (readers before it ignore a fifth
        // field), so that judging a checkpoint's epoch reads one line.
        let mut out = format!(
            "{MAGIC} {} {} {} {}\n",
            self.version,
            hash.to_hex(),
            body.len(),
            self.epoch
        )
        .into_bytes();
        out.extend_from_slice(&body);
        Ok(out)
    }

    /// The stored form split at its header line, within the size cap.
    fn split(bytes: &[u8], object: &str) -> Result<usize> {
        let bad = |reason: String| Error::corrupt(object, None, reason);
        if bytes.len() > MAX_MANIFEST_BYTES {
            return Err(bad(format!(
                "manifest of {} bytes exceeds the cap",
                bytes.len()
            )));
        }
        bytes
            .iter()
            .take(256)
            .position(|&b| b == b'\n')
            .ok_or_else(|| bad("no manifest header".into()))
    }

    /// The stored form's body, parsed but not verified (its hash is not
    /// checked: a load does that). For what a checkpoint references and who
    /// saved it, read even from a damaged copy.
    pub fn decode_unverified(bytes: &[u8], object: &str) -> Result<Manifest> {
        let nl = Self::split(bytes, object)?;
        serde_json::from_slice(&bytes[nl + 1..])
            .map_err(|e| Error::corrupt(object, None, format!("manifest does not parse: {e}")))
    }

    /// Decode and validate the stored form. `object` names the key in errors.
    pub fn decode(bytes: &[u8], object: &str) -> Result<Manifest> {
        let bad = |reason: String| Error::corrupt(object, None, reason);
        let nl = Self::split(bytes, object)?;
        let header =
            std::str::from_utf8(&bytes[..nl]).map_err(|_| bad("header is not UTF-8".into()))?;
        let mut fields = header.split(' ');
        if fields.next() != Some(MAGIC) {
            return Err(bad("not a ckpt manifest".into()));
        }
        let version: u32 = fields
            .next()
            .and_then(|v| v.parse().ok())
            .ok_or_else(|| bad("bad version field".into()))?;
        let hash = fields.next().ok_or_else(|| bad("no hash field".into()))?;
        let len: usize = fields
            .next()
            .and_then(|v| v.parse().ok())
            .ok_or_else(|| bad("bad length field".into()))?;
        let header_epoch = fields.next();
        let body = &bytes[nl + 1..];
        if body.len() != len {
            return Err(bad(format!(
                "body is {} bytes, header says {len} (truncated?)",
                body.len()
            )));
        }
        if blake3::hash(body).to_hex().as_str() != hash {
            return Err(bad("manifest hash mismatch".into()));
        }
        if ![
            MANIFEST_VERSION,
            MANIFEST_VERSION_FRAGMENTS,
            MANIFEST_VERSION_INLINE,
        ]
        .contains(&version)
        {
            // Another schema only if the body (which the hash covers, unlike
            // the header) says so too: a damaged version digit in the header
            // is damage, which a load falls back past, not a newer writer's
            // checkpoint, which it must not pass over.
            #[derive(Deserialize)]
            struct Versioned {
                version: u32,
            }
            return Err(match serde_json::from_slice::<Versioned>(body) {
                Ok(v) if v.version == version => Error::Unsupported(format!(
                    "manifest `{object}` has schema version {version}; this library reads {MANIFEST_VERSION}"
                )),
                _ => bad(format!(
                    "the header says schema version {version}, and the body does not (damaged header)"
                )),
            });
        }
        let m: Manifest = serde_json::from_slice(body)
            .map_err(|e| bad(format!("manifest does not parse: {e}")))?;
        if m.version != version {
            return Err(bad(format!(
                "the header says schema version {version}, the body {} (damaged header)",
                m.version
            )));
        }
        if header_epoch.is_some_and(|e| e.parse::<u64>().ok() != Some(m.epoch)) {
            return Err(bad(
                "the header's epoch is not the body's (damaged header)".into()
            ));
        }
        m.validate().map_err(|e| match e {
            Error::InvalidInput(reason) => bad(reason),
            other => other,
        })?;
        Ok(m)
    }

    /// The epoch a stored manifest's header line says, if it says one
    /// (written since the header carries it). Not verified: a load checks it
    /// against the body, and a damaged one is damage there.
    pub fn header_epoch(head: &[u8]) -> Option<u64> {
        let nl = head.iter().take(256).position(|&b| b == b'\n')?;
        let line = std::str::from_utf8(&head[..nl]).ok()?;
        let mut f = line.split(' ');
        (f.next()? == MAGIC).then_some(())?;
        f.nth(3)?.parse().ok()
    }

    /// Check internal consistency (used on decode, and before commit).
    pub fn validate(&self) -> Result<()> {
        let bad = |s: String| Error::InvalidInput(s);
        if !self.attempt.bytes().all(|b| b.is_ascii_alphanumeric()) || self.attempt.is_empty() {
            return Err(bad(format!("bad attempt id `{}`", self.attempt)));
        }
        let fragmented = self.version >= MANIFEST_VERSION_FRAGMENTS;
        if fragmented != self.has_fragments() || (!fragmented && !self.index.is_empty()) {
            return Err(bad(format!(
                "schema version {} with {} fragments and {} index entries",
                self.version,
                self.fragments.len(),
                self.index.len()
            )));
        }
        if fragmented {
            // Its own records: exactly those of the replicated tensors.
            let in_root: std::collections::HashSet<&str> = self
                .index
                .iter()
                .filter(|e| e.in_root())
                .map(|e| e.name.as_str())
                .collect();
            let only_replicas = self.tensors.len() == in_root.len()
                && self
                    .tensors
                    .iter()
                    .all(|t| t.shard.is_none() && in_root.contains(t.name.as_str()));
            if !only_replicas {
                return Err(bad(
                    "a root with fragments holds the records of its replicated tensors, and no others".into(),
                ));
            }
            crate::layout::fragment::validate_refs(&self.fragments, self.world_size)
                .map_err(bad)?;
            index::validate(&self.index, self.world_size).map_err(bad)?;
        }
        validate_records(&self.tensors, &self.objects)
    }
}

/// Check a list of records and objects: names, pieces, sizes and keys
/// consistent (a manifest's, or one fragment's).
pub(crate) fn validate_records(tensors: &[TensorRecord], objects: &[String]) -> Result<()> {
    let bad = |s: String| Error::InvalidInput(s);
    {
        // A name is either one unsharded tensor, or pieces of one sharded tensor
        // (same dtype and global shape, distinct offsets).
        let mut names: HashMap<&str, &TensorRecord> = HashMap::with_capacity(tensors.len());
        let mut pieces = HashSet::new();
        for t in tensors {
            if t.name.is_empty() {
                return Err(bad("empty tensor name".into()));
            }
            if let Some(s) = &t.shard {
                if s.global_shape.len() != t.shape.len()
                    || s.offsets.len() != t.shape.len()
                    || s.offsets
                        .iter()
                        .zip(&t.shape)
                        .zip(&s.global_shape)
                        .any(|((o, l), g)| o.checked_add(*l).is_none_or(|e| e > *g))
                {
                    return Err(bad(format!(
                        "tensor `{}`: shard does not fit its global shape",
                        t.name
                    )));
                }
                if !pieces.insert((t.name.as_str(), s.offsets.clone())) {
                    return Err(bad(format!(
                        "tensor `{}`: two pieces at offsets {:?}",
                        t.name, s.offsets
                    )));
                }
            }
            if let Some(prev) = names.insert(t.name.as_str(), t) {
                let same = match (&prev.shard, &t.shard) {
                    (Some(a), Some(b)) => a.global_shape == b.global_shape && prev.dtype == t.dtype,
                    _ => false,
                };
                if !same {
                    return Err(bad(format!("duplicate tensor name `{}`", t.name)));
                }
            }
            let want = t
                .nbytes()
                .map_err(|e| bad(format!("tensor `{}`: {e}", t.name)))?;
            let have = t.layout.raw_len()?;
            if want != have {
                return Err(bad(format!(
                    "tensor `{}` needs {want} bytes, layout has {have}",
                    t.name
                )));
            }
            match &t.layout {
                Layout::Chunks { chunks } => {
                    for c in chunks {
                        if !is_hash(&c.hash) {
                            return Err(bad(format!("tensor `{}`: bad chunk hash", t.name)));
                        }
                        if c.offset.is_some_and(|o| o.checked_add(c.len).is_none()) {
                            return Err(bad(format!("tensor `{}`: chunk slice overflows", t.name)));
                        }
                    }
                }
                Layout::Range {
                    object,
                    offset,
                    len,
                    blake3,
                } => {
                    check_key(object).map_err(bad)?;
                    offset
                        .checked_add(*len)
                        .ok_or_else(|| bad(format!("tensor `{}`: range overflows", t.name)))?;
                    if !is_hash(blake3) {
                        return Err(bad(format!("tensor `{}`: bad hash", t.name)));
                    }
                }
            }
        }
        for o in objects {
            check_key(o).map_err(bad)?;
        }
        Ok(())
    }
}

/// True for 64 lowercase hex digits.
pub fn is_hash(s: &str) -> bool {
    s.len() == 64 && s.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
}

/// A stored key must be relative and stay under the root.
pub(crate) fn check_key(key: &str) -> std::result::Result<(), String> {
    if key.is_empty()
        || key.starts_with('/')
        || key
            .split('/')
            .any(|p| p.is_empty() || p == "." || p == "..")
    {
        return Err(format!("object key `{key}` is not a plain relative path"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Manifest {
        Manifest {
            version: MANIFEST_VERSION_INLINE,
            library: "ckpt test".into(),
            format: "native".into(),
            step: 7,
            attempt: "abc".into(),
            world_size: 1,
            created_unix_ms: 1,
            epoch: 0,
            tensors: vec![TensorRecord {
                name: "w".into(),
                dtype: DType::F32,
                shape: vec![2],
                shard: None,
                layout: Layout::Chunks {
                    chunks: vec![ChunkRef {
                        hash: "a".repeat(64),
                        len: 8,
                        stored: 24,
                        offset: None,
                    }],
                },
            }],
            meta: Value::Int(3),
            objects: vec![],
            fragments: vec![],
            index: vec![],
        }
    }

    #[test]
    fn round_trip() {
        let m = sample();
        let bytes = m.encode().unwrap();
        assert_eq!(Manifest::decode(&bytes, "m").unwrap(), m);
    }

    #[test]
    fn every_flipped_byte_is_detected() {
        let bytes = sample().encode().unwrap();
        for i in 0..bytes.len() {
            let mut b = bytes.clone();
            b[i] ^= 0x01;
            // Damage, never "another version": a load falls back past it.
            match Manifest::decode(&b, "m") {
                Err(e) => assert!(e.is_damage(), "flip at {i}: {e}"),
                Ok(_) => panic!("flip at {i} not detected"),
            }
        }
        for cut in 0..bytes.len() {
            assert!(
                Manifest::decode(&bytes[..cut], "m").is_err(),
                "truncation at {cut} not detected"
            );
        }
    }

    #[test]
    fn another_schema_version_is_unsupported_only_when_the_body_says_so() {
        let mut m = sample();
        m.version = MANIFEST_VERSION + 1;
        let body = serde_json::to_vec(&m).unwrap();
        let header = format!(
            "{MAGIC} {} {} {}\n",
            MANIFEST_VERSION + 1,
            blake3::hash(&body).to_hex(),
            body.len()
        );
        let newer = [header.as_bytes(), &body].concat();
        match Manifest::decode(&newer, "m") {
            Err(Error::Unsupported(msg)) => assert!(
                msg.contains(&format!("schema version {}", MANIFEST_VERSION + 1)),
                "{msg}"
            ),
            other => panic!("expected Unsupported, got {other:?}"),
        }
        // The same header over this version's body: a damaged header.
        let ours = sample().encode().unwrap();
        let nl = ours.iter().position(|&b| b == b'\n').unwrap();
        let body = &ours[nl + 1..];
        let header = format!(
            "{MAGIC} {} {} {}\n",
            MANIFEST_VERSION + 1,
            blake3::hash(body).to_hex(),
            body.len()
        );
        let flipped = [header.as_bytes(), body].concat();
        match Manifest::decode(&flipped, "m") {
            Err(e @ Error::Corrupt { .. }) => {
                assert!(e.to_string().contains("damaged header"), "{e}")
            }
            other => panic!("expected Corrupt, got {other:?}"),
        }
    }

    #[test]
    fn rejects_inconsistent_sizes_and_keys() {
        let mut m = sample();
        m.shape_mut_for_test();
        assert!(matches!(
            Manifest::decode(&m.encode().unwrap(), "m"),
            Err(Error::Corrupt { .. })
        ));
        let mut m = sample();
        m.objects.push("../escape".into());
        assert!(Manifest::decode(&m.encode().unwrap(), "m").is_err());
    }

    impl Manifest {
        fn shape_mut_for_test(&mut self) {
            self.tensors[0].shape = vec![3];
        }
    }
}
