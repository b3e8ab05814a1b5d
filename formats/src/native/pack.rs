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
    /// The chunk's raw bytes (a slice of the tensor for split tensors, no copy).
    pub data: Bytes,
    /// The tensors it holds.
    pub members: Vec<Member>,
    /// True for a chunk shared by packed tensors.
    pub packed: bool,
}

/// Tensors smaller than `chunk_size / PACK_DIVISOR` are packed.
pub const PACK_DIVISOR: usize = 4;

/// Plan the chunks of `tensors` for a chunk size of `size` bytes.
pub fn plan(tensors: &[Tensor], size: usize) -> Vec<Piece> {
    let size = size.max(1);
    let small = size / PACK_DIVISOR;
    let mut out = Vec::new();
    // Bytes still to pack, so each pack buffer is allocated once at its final
    // size (growing it by doubling copied every packed byte about twice more).
    let mut unpacked: usize = tensors
        .iter()
        .map(|t| t.data.len())
        .filter(|&l| l > 0 && l < small)
        .sum();
    let mut pack = BytesMut::new();
    let mut members = Vec::new();
    let flush = |pack: &mut BytesMut, members: &mut Vec<Member>, out: &mut Vec<Piece>| {
        if !members.is_empty() {
            out.push(Piece {
                data: pack.split().freeze(),
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
            if pack.len() + len > size {
                flush(&mut pack, &mut members, &mut out);
            }
            if pack.capacity() - pack.len() < len {
                pack.reserve(unpacked.min(size).max(len));
            }
            unpacked -= len;
            members.push(Member {
                tensor: i,
                offset: pack.len(),
                len,
            });
            pack.extend_from_slice(&t.data);
            continue;
        }
        for off in (0..len).step_by(size) {
            let end = (off + size).min(len);
            out.push(Piece {
                data: t.data.slice(off..end),
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
                prop_assert!(p.data.len() <= size.max(1) || !p.packed);
                for m in &p.members {
                    rebuilt[m.tensor].extend_from_slice(&p.data[m.offset..m.offset + m.len]);
                }
            }
            for (t, r) in tensors.iter().zip(&rebuilt) {
                prop_assert_eq!(&t.data[..], &r[..]);
            }
            // Deterministic.
            let again = plan(&tensors, size);
            prop_assert_eq!(pieces.len(), again.len());
            for (a, b) in pieces.iter().zip(&again) {
                prop_assert_eq!(&a.data, &b.data);
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
}
