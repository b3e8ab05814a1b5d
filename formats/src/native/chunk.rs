//! The stored form of one chunk: a 64-byte header and the payload.
//!
//! ```text
//! b"CKC2" | codec: u8 (0 raw, 1 zstd) | 3 reserved zero bytes | raw length: u64 LE | 48 zero bytes | payload
//! ```
//!
//! The payload starts 64 bytes into the object, so a raw chunk's bytes are as
//! aligned in its file as a tensor's in memory (a cache line or more): the
//! kernel copies a file into a tensor about 1.5x as fast when the two agree
//! modulo 64 bytes as when they are 16 bytes apart. Chunks written before
//! (`CKC1`: the same first 16 bytes, the payload right after them) are read
//! as before; [`header`] tells the two apart.
//!
//! Pure functions over bytes, size-capped, checked arithmetic. The chunk's name is
//! the blake3 hash of its raw bytes, and [`decode`] verifies it.

use bytes::Bytes;
use ckpt_core::Compression;

use crate::error::CodecError;

/// Length in bytes of the header chunks are written with (`CKC2`), and the
/// most any header takes.
pub const HEADER_LEN: usize = 64;
/// Length in bytes of the header of chunks written before (`CKC1`), the least
/// a header takes.
pub const V1_HEADER_LEN: usize = 16;

// Staging buffers start this far into a page so that chunk data is as aligned
// in memory as in its file, and a local store can write it with O_DIRECT
// without copying it first.
const _: () = assert!(HEADER_LEN == ckpt_core::staging::STAGING_LEAD);
const MAGIC: &[u8; 4] = b"CKC2";
const V1_MAGIC: &[u8; 4] = b"CKC1";
const RAW: u8 = 0;
const ZSTD: u8 = 1;

/// An encoded chunk: header plus payload, kept apart so raw payloads are never copied.
#[derive(Debug, Clone)]
pub struct Encoded {
    /// The header.
    pub header: [u8; HEADER_LEN],
    /// The payload, in order: the raw parts themselves when not compressed.
    pub payload: Vec<Bytes>,
}

impl Encoded {
    /// Stored length.
    pub fn len(&self) -> u64 {
        (HEADER_LEN + self.payload.iter().map(Bytes::len).sum::<usize>()) as u64
    }

    /// Never empty (the header is always there).
    pub fn is_empty(&self) -> bool {
        false
    }

    /// The parts to upload, in order.
    pub fn parts(self) -> Vec<Bytes> {
        let mut out = Vec::with_capacity(1 + self.payload.len());
        out.push(Bytes::copy_from_slice(&self.header));
        out.extend(self.payload);
        out
    }
}

fn new_header(codec: u8, raw_len: u64) -> [u8; HEADER_LEN] {
    let mut h = [0u8; HEADER_LEN];
    h[..4].copy_from_slice(MAGIC);
    h[4] = codec;
    h[8..16].copy_from_slice(&raw_len.to_le_bytes());
    h
}

/// Encode raw bytes, given as parts in order (a packed chunk's members).
/// Compression is kept only when it makes the chunk smaller; only then are the
/// parts joined into one buffer.
pub fn encode(raw: &[Bytes], compression: Compression) -> Result<Encoded, CodecError> {
    let raw_len: usize = raw.iter().map(Bytes::len).sum();
    if let Compression::Zstd(level) = compression {
        let joined = crate::native::pack::Piece::joined(raw);
        let packed = zstd::bulk::compress(&joined, level)
            .map_err(|e| CodecError::Malformed(format!("zstd: {e}")))?;
        if packed.len() < raw_len {
            return Ok(Encoded {
                header: new_header(ZSTD, raw_len as u64),
                payload: vec![Bytes::from(packed)],
            });
        }
    }
    Ok(Encoded {
        header: new_header(RAW, raw_len as u64),
        payload: raw.to_vec(),
    })
}

/// The blake3 hash (hex) of raw bytes given as parts in order: the chunk's name.
pub fn hash_parts(raw: &[Bytes]) -> String {
    match raw {
        [one] => blake3::hash(one),
        _ => {
            let mut h = blake3::Hasher::new();
            for p in raw {
                h.update(p);
            }
            h.finalize()
        }
    }
    .to_hex()
    .to_string()
}

/// What a stored chunk's header says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    /// Where the payload starts: the header's length ([`HEADER_LEN`], or
    /// [`V1_HEADER_LEN`] for a chunk written before).
    pub len: usize,
    /// The raw length it claims.
    pub raw_len: u64,
    codec: u8,
}

impl Header {
    /// Whether the payload is the raw bytes themselves (not compressed).
    pub fn is_raw(&self) -> bool {
        self.codec == RAW
    }
}

/// Check a stored chunk's header, given the chunk's first bytes: [`HEADER_LEN`]
/// of them, or all of a shorter chunk.
pub fn header(stored: &[u8]) -> Result<Header, CodecError> {
    let short =
        || CodecError::Truncated(format!("{} bytes, shorter than the header", stored.len()));
    let head = stored.get(..V1_HEADER_LEN).ok_or_else(short)?;
    let len = match &head[..4] {
        m if m == MAGIC => HEADER_LEN,
        m if m == V1_MAGIC => V1_HEADER_LEN,
        _ => return Err(CodecError::Malformed("bad chunk magic".into())),
    };
    let pad = stored.get(V1_HEADER_LEN..len).ok_or_else(short)?;
    if head[5..8] != [0, 0, 0] || pad.iter().any(|&b| b != 0) {
        return Err(CodecError::Malformed(
            "reserved header bytes are not zero".into(),
        ));
    }
    let mut len8 = [0u8; 8];
    len8.copy_from_slice(&head[8..16]);
    Ok(Header {
        len,
        raw_len: u64::from_le_bytes(len8),
        codec: head[4],
    })
}

/// Decode a stored chunk and verify that blake3 of the raw bytes is `hash` (hex).
///
/// `max_raw` caps the raw length a header may claim. Raw payloads come back as a
/// slice of `stored` (no copy).
pub fn decode(stored: Bytes, hash: &str, max_raw: usize) -> Result<Bytes, CodecError> {
    let h = header(&stored)?;
    let raw_len = usize::try_from(h.raw_len)
        .ok()
        .filter(|&l| l <= max_raw)
        .ok_or_else(|| CodecError::TooLarge(format!("chunk claims {} raw bytes", h.raw_len)))?;
    let payload = stored.slice(h.len..);
    let raw = match h.codec {
        RAW => {
            if payload.len() != raw_len {
                return Err(CodecError::Truncated(format!(
                    "payload is {} of {raw_len} bytes",
                    payload.len()
                )));
            }
            payload
        }
        ZSTD => {
            let out = zstd::bulk::decompress(&payload, raw_len)
                .map_err(|e| CodecError::Malformed(format!("zstd: {e}")))?;
            if out.len() != raw_len {
                return Err(CodecError::Truncated(format!(
                    "decompressed {} of {raw_len} bytes",
                    out.len()
                )));
            }
            Bytes::from(out)
        }
        c => return Err(CodecError::Malformed(format!("unknown codec {c}"))),
    };
    verify(&raw, hash)?;
    Ok(raw)
}

/// The payload of a stored chunk kept raw (not compressed), checked against
/// its header and `raw_len`; `None` for a compressed chunk. Its hash is not
/// checked here: [`verify`] does that, on any thread.
pub fn raw_payload(stored: &Bytes, raw_len: usize) -> Result<Option<Bytes>, CodecError> {
    let h = header(stored)?;
    let claimed = h.raw_len;
    if !h.is_raw() {
        return Ok(None);
    }
    let payload = stored.slice(h.len..);
    if claimed != raw_len as u64 || payload.len() != raw_len {
        return Err(CodecError::Truncated(format!(
            "payload is {} bytes, header says {claimed}, expected {raw_len}",
            payload.len()
        )));
    }
    Ok(Some(payload))
}

/// Check raw bytes given as parts in order (a packed chunk read straight into
/// its tensors) against their chunk hash.
pub fn verify_parts(raw: &[&[u8]], hash: &str) -> Result<(), CodecError> {
    let mut h = blake3::Hasher::new();
    for p in raw {
        h.update(p);
    }
    if h.finalize().to_hex().as_str() != hash {
        return Err(CodecError::HashMismatch);
    }
    Ok(())
}

/// Check raw bytes against their chunk hash.
pub fn verify(raw: &[u8], hash: &str) -> Result<(), CodecError> {
    if blake3::hash(raw).to_hex().as_str() != hash {
        return Err(CodecError::HashMismatch);
    }
    Ok(())
}

/// Decode a stored chunk straight into `dst` (which must be exactly the raw
/// length) and verify its hash.
pub fn decode_into(stored: &[u8], hash: &str, dst: &mut [u8]) -> Result<(), CodecError> {
    let h = header(stored)?;
    let claimed = h.raw_len;
    if claimed != dst.len() as u64 {
        return Err(CodecError::Malformed(format!(
            "chunk holds {claimed} raw bytes, expected {}",
            dst.len()
        )));
    }
    let payload = &stored[h.len..];
    match h.codec {
        RAW if payload.len() == dst.len() => dst.copy_from_slice(payload),
        RAW => {
            return Err(CodecError::Truncated(format!(
                "payload is {} of {} bytes",
                payload.len(),
                dst.len()
            )))
        }
        ZSTD => {
            let n = zstd::bulk::decompress_to_buffer(payload, dst)
                .map_err(|e| CodecError::Malformed(format!("zstd: {e}")))?;
            if n != dst.len() {
                return Err(CodecError::Truncated(format!(
                    "decompressed {n} of {} bytes",
                    dst.len()
                )));
            }
        }
        c => return Err(CodecError::Malformed(format!("unknown codec {c}"))),
    }
    verify(dst, hash)
}

/// Concatenate an encoded chunk into one buffer (tests, fuzzing).
pub fn to_vec(e: &Encoded) -> Vec<u8> {
    let mut v = Vec::with_capacity(e.len() as usize);
    v.extend_from_slice(&e.header);
    for p in &e.payload {
        v.extend_from_slice(p);
    }
    v
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn round_trip(data in proptest::collection::vec(any::<u8>(), 0..4096), level in prop_oneof![Just(0), 1..4i32], cuts in proptest::collection::vec(any::<prop::sample::Index>(), 0..4)) {
            let raw = Bytes::from(data);
            let c = if level == 0 { Compression::None } else { Compression::Zstd(level) };
            // The same bytes given as parts (a packed chunk's members) encode and hash alike.
            let mut at: Vec<usize> = cuts.iter().map(|i| i.index(raw.len() + 1)).collect();
            at.sort_unstable();
            let parts: Vec<Bytes> = [0].into_iter().chain(at.iter().copied()).zip(at.iter().copied().chain([raw.len()])).map(|(a, b)| raw.slice(a..b)).collect();
            let enc = encode(&parts, c).unwrap();
            let hash = blake3::hash(&raw).to_hex().to_string();
            prop_assert_eq!(&hash_parts(&parts), &hash);
            prop_assert_eq!(enc.len() as usize, to_vec(&enc).len());
            prop_assert_eq!(decode(Bytes::from(to_vec(&enc)), &hash, 1 << 20).unwrap(), raw);
        }

        #[test]
        fn any_damage_is_detected(data in proptest::collection::vec(any::<u8>(), 1..2048), pos in any::<prop::sample::Index>(), bit in 0..8u8, z in any::<bool>()) {
            let raw = Bytes::from(data);
            let enc = encode(std::slice::from_ref(&raw), if z { Compression::Zstd(3) } else { Compression::None }).unwrap();
            let hash = blake3::hash(&raw).to_hex().to_string();
            let mut v = to_vec(&enc);
            let i = pos.index(v.len());
            v[i] ^= 1 << bit;
            prop_assert!(decode(Bytes::from(v.clone()), &hash, 1 << 20).is_err());
            let cut = pos.index(v.len());
            let good = to_vec(&enc);
            prop_assert!(decode(Bytes::copy_from_slice(&good[..cut]), &hash, 1 << 20).is_err());
        }
    }

    #[test]
    fn payloads_start_64_bytes_in_and_earlier_16_byte_headers_decode() {
        let raw = Bytes::from(
            (0..5000u32)
                .map(|i| (i * 7 % 251) as u8)
                .collect::<Vec<_>>(),
        );
        let hash = blake3::hash(&raw).to_hex().to_string();
        for c in [Compression::None, Compression::Zstd(3)] {
            let v2 = to_vec(&encode(std::slice::from_ref(&raw), c).unwrap());
            let h = header(&v2).unwrap();
            assert_eq!(
                (h.len, h.raw_len, h.is_raw()),
                (HEADER_LEN, 5000, c == Compression::None)
            );
            // The same chunk as written before: `CKC1` and the first 16 bytes.
            let mut v1 = v2[..V1_HEADER_LEN].to_vec();
            v1[..4].copy_from_slice(b"CKC1");
            v1.extend_from_slice(&v2[HEADER_LEN..]);
            let h1 = header(&v1).unwrap();
            assert_eq!(
                (h1.len, h1.raw_len, h1.is_raw()),
                (V1_HEADER_LEN, 5000, h.is_raw())
            );
            for stored in [&v1, &v2] {
                assert_eq!(
                    decode(Bytes::from(stored.clone()), &hash, 1 << 20).unwrap(),
                    raw
                );
                let mut dst = vec![0u8; raw.len()];
                decode_into(stored, &hash, &mut dst).unwrap();
                assert_eq!(dst, raw);
                let payload = raw_payload(&Bytes::from(stored.clone()), raw.len()).unwrap();
                assert_eq!(payload.is_some(), h.is_raw());
            }
            // A `CKC2` header cut inside its zero bytes is short, not a `CKC1` one.
            assert!(matches!(header(&v2[..40]), Err(CodecError::Truncated(_))));
        }
    }

    #[test]
    fn compression_shrinks_repetitive_data_and_caps_hold() {
        let raw = Bytes::from(vec![7u8; 1 << 16]);
        let enc = encode(std::slice::from_ref(&raw), Compression::Zstd(3)).unwrap();
        assert!(enc.len() < 1000);
        let hash = blake3::hash(&raw).to_hex().to_string();
        assert!(matches!(
            decode(Bytes::from(to_vec(&enc)), &hash, 1000),
            Err(CodecError::TooLarge(_))
        ));
    }
}
