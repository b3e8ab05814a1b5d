//! How tensors map onto chunks: large tensors are split into chunks of
//! `chunk_size`; small ones are packed, in order, into shared chunks of up to
//! `chunk_size`, so a state of a thousand small tensors is a few dozen objects
//! rather than a thousand. Pure and deterministic: the same tensors give the same
//! chunks, hence the same hashes (incremental saves and determinism rely on it).

use bytes::{Bytes, BytesMut};
use ckpt_core::Tensor;

/// A tensor's bytes inside a chunk.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Member {
    /// Index of the tensor in the input.
    pub tensor: usize,
    /// Where its bytes start in the chunk.
    pub offset: usize,
    /// How many bytes.
    pub len: usize,
}

/// One chunk to write.
#[derive(Debug, Clone)]
pub struct Piece {
    /// The chunk's raw bytes, in order: slices of the tensors themselves, never
    /// copied here (one part for a split tensor, one per member for a pack).
    pub parts: Vec<Bytes>,
    /// The tensors it holds.
    pub members: Vec<Member>,
    /// True for a chunk shared by packed tensors.
    pub packed: bool,
}

impl Piece {
    /// Raw length of the chunk.
    pub fn len(&self) -> usize {
        self.parts.iter().map(Bytes::len).sum()
    }

    /// True for a chunk of no bytes (never planned).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The chunk's bytes in one buffer: the part itself for a single part, else
    /// a copy (for codecs that need contiguous input).
    pub fn joined(parts: &[Bytes]) -> Bytes {
        match parts {
            [one] => one.clone(),
            _ => {
                let mut out = BytesMut::with_capacity(parts.iter().map(Bytes::len).sum());
                for p in parts {
                    out.extend_from_slice(p);
                }
                out.freeze()
            }
        }
    }
}

/// Tensors smaller than `chunk_size / PACK_DIVISOR` are packed.
pub const PACK_DIVISOR: usize = 4;

/// Plan the chunks of `tensors` for a chunk size of `size` bytes. Nothing is
/// copied: a packed chunk lists its members' bytes, and whoever hashes and
/// writes it streams them in order (on its own thread, chunks in parallel).
pub fn plan(tensors: &[Tensor], size: usize) -> Vec<Piece> {
    let size = size.max(1);
    let small = size / PACK_DIVISOR;
    let mut out = Vec::new();
    let mut pack: Vec<Bytes> = Vec::new();
    let mut packed_len = 0usize;
    let mut members = Vec::new();
    let flush = |pack: &mut Vec<Bytes>, members: &mut Vec<Member>, out: &mut Vec<Piece>| {
        if !members.is_empty() {
            out.push(Piece {
                parts: std::mem::take(pack),
                members: std::mem::take(members),
                packed: true,
            });
        }
    };
    for (i, t) in tensors.iter().enumerate() {
        let len = t.data.len();
        if len == 0 {
            continue;
        }
        if len < small {
            if packed_len + len > size {
                flush(&mut pack, &mut members, &mut out);
                packed_len = 0;
            }
            members.push(Member {
                tensor: i,
                offset: packed_len,
                len,
            });
            pack.push(t.data.clone());
            packed_len += len;
            continue;
        }
        for off in (0..len).step_by(size) {
            let end = (off + size).min(len);
            out.push(Piece {
                parts: vec![t.data.slice(off..end)],
                members: vec![Member {
                    tensor: i,
                    offset: 0,
                    len: end - off,
                }],
                packed: false,
            });
        }
    }
    flush(&mut pack, &mut members, &mut out);
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use ckpt_core::DType;
    use proptest::prelude::*;

    fn t(i: usize, len: usize) -> Tensor {
        Tensor::new(
            format!("t{i}"),
            DType::U8,
            vec![len as u64],
            (0..len).map(|b| (b + i) as u8).collect::<Vec<u8>>(),
        )
        .unwrap()
    }

    proptest! {
        #[test]
        fn every_byte_lands_once_and_in_order(lens in proptest::collection::vec(0usize..300, 0..40), size in 1usize..256) {
            let tensors: Vec<Tensor> = lens.iter().enumerate().map(|(i, &l)| t(i, l)).collect();
            let pieces = plan(&tensors, size);
            let mut rebuilt: Vec<Vec<u8>> = vec![Vec::new(); tensors.len()];
            for p in &pieces {
                prop_assert!(p.len() <= size.max(1) || !p.packed);
                let data = Piece::joined(&p.parts);
                prop_assert_eq!(data.len(), p.len());
                for m in &p.members {
                    rebuilt[m.tensor].extend_from_slice(&data[m.offset..m.offset + m.len]);
                }
            }
            for (t, r) in tensors.iter().zip(&rebuilt) {
                prop_assert_eq!(&t.data[..], &r[..]);
            }
            // Deterministic.
            let again = plan(&tensors, size);
            prop_assert_eq!(pieces.len(), again.len());
            for (a, b) in pieces.iter().zip(&again) {
                prop_assert_eq!(&a.parts, &b.parts);
                prop_assert_eq!(&a.members, &b.members);
            }
        }
    }

    #[test]
    fn small_tensors_share_chunks_and_large_ones_do_not() {
        let tensors: Vec<Tensor> = (0..100).map(|i| t(i, 10)).chain([t(100, 1000)]).collect();
        let pieces = plan(&tensors, 400);
        let packed: Vec<&Piece> = pieces.iter().filter(|p| p.packed).collect();
        assert_eq!(
            packed.len(),
            3,
            "1000 bytes of small tensors in 400-byte packs"
        );
        assert_eq!(
            pieces.iter().filter(|p| !p.packed).count(),
            3,
            "1000 bytes split in 400s"
        );
    }

    #[test]
    fn planning_copies_no_bytes() {
        let tensors: Vec<Tensor> = (0..20).map(|i| t(i, 10 + i)).chain([t(20, 1000)]).collect();
        for p in plan(&tensors, 400) {
            for (part, m) in p.parts.iter().zip(&p.members) {
                let src = &tensors[m.tensor].data;
                let within = (part.as_ptr() as usize).wrapping_sub(src.as_ptr() as usize);
                assert!(
                    within <= src.len() && within + part.len() <= src.len(),
                    "part of tensor {} is not a slice of its bytes",
                    m.tensor
                );
            }
        }
    }
}
