//! Resharding: copy the overlap of two row-major boxes of one global tensor.
//!
//! A saved piece covers `[src_off, src_off + src_shape)` of the global tensor; a
//! wanted piece covers `[dst_off, dst_off + dst_shape)`. [`copy_overlap`] copies the
//! elements in both, wherever they lie, with checked arithmetic. Pure.

use crate::error::{Error, Result};

/// A box inside a global tensor: offsets and extents per dimension.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Region<'a> {
    /// Offset of the box in each dimension.
    pub offsets: &'a [u64],
    /// Extent of the box in each dimension.
    pub shape: &'a [u64],
}

/// The intersection of two boxes, as (offsets, shape), or `None` when empty.
pub fn intersect(a: &Region<'_>, b: &Region<'_>) -> Option<(Vec<u64>, Vec<u64>)> {
    let mut off = Vec::with_capacity(a.offsets.len());
    let mut shape = Vec::with_capacity(a.offsets.len());
    for d in 0..a.offsets.len() {
        let lo = a.offsets[d].max(b.offsets[d]);
        let hi = (a.offsets[d] + a.shape[d]).min(b.offsets[d] + b.shape[d]);
        if hi <= lo {
            return None;
        }
        off.push(lo);
        shape.push(hi - lo);
    }
    Some((off, shape))
}

fn strides(shape: &[u64], elem: u64) -> Result<Vec<u64>> {
    let mut s = vec![0u64; shape.len()];
    let mut acc = elem;
    for d in (0..shape.len()).rev() {
        s[d] = acc;
        acc = acc
            .checked_mul(shape[d])
            .ok_or_else(|| Error::InvalidInput("tensor size overflows".into()))?;
    }
    Ok(s)
}

/// Copy the overlap of `src` (bytes of the box `src_region`) into `dst` (bytes of
/// `dst_region`); `elem` is the element size in bytes. Returns the bytes copied.
pub fn copy_overlap(
    src: &[u8],
    src_region: &Region<'_>,
    dst: &mut [u8],
    dst_region: &Region<'_>,
    elem: u64,
) -> Result<u64> {
    let rank = src_region.shape.len();
    if src_region.offsets.len() != rank
        || dst_region.offsets.len() != rank
        || dst_region.shape.len() != rank
    {
        return Err(Error::InvalidInput(
            "reshard: boxes of different rank".into(),
        ));
    }
    let size = |r: &Region<'_>| -> Result<u64> {
        r.shape
            .iter()
            .try_fold(elem, |a, &d| a.checked_mul(d))
            .ok_or_else(|| Error::InvalidInput("size overflows".into()))
    };
    if size(src_region)? != src.len() as u64 || size(dst_region)? != dst.len() as u64 {
        return Err(Error::InvalidInput(
            "reshard: buffer sizes do not match their boxes".into(),
        ));
    }
    let Some((off, shape)) = intersect(src_region, dst_region) else {
        return Ok(0);
    };
    if rank == 0 {
        dst.copy_from_slice(src);
        return Ok(elem);
    }
    let ss = strides(src_region.shape, elem)?;
    let ds = strides(dst_region.shape, elem)?;
    // Copy rows along the last dimension; iterate over all other dimensions.
    let row = shape[rank - 1] * elem;
    let outer: u64 = shape[..rank - 1].iter().product();
    let mut idx = vec![0u64; rank - 1];
    let mut copied = 0;
    for _ in 0..outer {
        let (mut so, mut dof) = (0u64, 0u64);
        for d in 0..rank {
            let i = if d < rank - 1 { idx[d] } else { 0 };
            so += (off[d] + i - src_region.offsets[d]) * ss[d];
            dof += (off[d] + i - dst_region.offsets[d]) * ds[d];
        }
        let (so, dof, row) = (so as usize, dof as usize, row as usize);
        dst[dof..dof + row].copy_from_slice(&src[so..so + row]);
        copied += row as u64;
        for d in (0..rank - 1).rev() {
            idx[d] += 1;
            if idx[d] < shape[d] {
                break;
            }
            idx[d] = 0;
        }
    }
    Ok(copied)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// The global tensor's element at a multi-index, as bytes (u16, distinct values).
    fn value(global: &[u64], at: &[u64]) -> u16 {
        let mut lin = 0u64;
        for (d, &i) in at.iter().enumerate() {
            lin = lin * global[d] + i;
        }
        lin as u16
    }

    fn fill(global: &[u64], off: &[u64], shape: &[u64]) -> Vec<u8> {
        let n: u64 = shape.iter().product();
        let mut out = Vec::with_capacity(n as usize * 2);
        let mut idx = vec![0u64; shape.len()];
        for _ in 0..n {
            let at: Vec<u64> = idx.iter().zip(off).map(|(i, o)| i + o).collect();
            out.extend_from_slice(&value(global, &at).to_le_bytes());
            for d in (0..shape.len()).rev() {
                idx[d] += 1;
                if idx[d] < shape[d] {
                    break;
                }
                idx[d] = 0;
            }
        }
        out
    }

    proptest! {
        #[test]
        fn pieces_of_any_split_assemble_any_other(
            global in proptest::collection::vec(1u64..6, 1..4),
            cuts_a in proptest::collection::vec(0u64..6, 3),
            cuts_b in proptest::collection::vec(0u64..6, 3),
        ) {
            // Split dimension 0 at a point for the source, and take one box for the destination.
            let d0 = global[0];
            let ca = cuts_a[0] % (d0 + 1);
            let (lo, hi) = { let a = cuts_b[0] % (d0 + 1); let b = cuts_b[1] % (d0 + 1); (a.min(b), a.max(b)) };
            prop_assume!(hi > lo);
            let mut dst_off = vec![0; global.len()];
            let mut dst_shape = global.clone();
            dst_off[0] = lo;
            dst_shape[0] = hi - lo;
            let mut dst = vec![0u8; (dst_shape.iter().product::<u64>() * 2) as usize];
            let mut total = 0;
            for (o, n) in [(0, ca), (ca, d0 - ca)] {
                if n == 0 { continue; }
                let mut off = vec![0; global.len()];
                let mut shape = global.clone();
                off[0] = o;
                shape[0] = n;
                let src = fill(&global, &off, &shape);
                total += copy_overlap(&src, &Region { offsets: &off, shape: &shape }, &mut dst, &Region { offsets: &dst_off, shape: &dst_shape }, 2).unwrap();
            }
            prop_assert_eq!(total, dst.len() as u64);
            prop_assert_eq!(dst, fill(&global, &dst_off, &dst_shape));
        }
    }

    #[test]
    fn two_d_blocks() {
        let global = [4u64, 6];
        let src_off = [1u64, 2];
        let src_shape = [3u64, 3];
        let src = fill(&global, &src_off, &src_shape);
        let dst_off = [0u64, 3];
        let dst_shape = [2u64, 3];
        let mut dst = vec![0u8; 12];
        let n = copy_overlap(
            &src,
            &Region {
                offsets: &src_off,
                shape: &src_shape,
            },
            &mut dst,
            &Region {
                offsets: &dst_off,
                shape: &dst_shape,
            },
            2,
        )
        .unwrap();
        // Overlap: row 1, columns 3..5 -> 2 elements.
        assert_eq!(n, 4);
        let want = fill(&global, &[1, 3], &[1, 2]);
        assert_eq!(&dst[6..10], &want[..]);
        assert!(copy_overlap(
            &src,
            &Region {
                offsets: &src_off,
                shape: &src_shape
            },
            &mut dst[..4],
            &Region {
                offsets: &dst_off,
                shape: &dst_shape
            },
            2
        )
        .is_err());
    }
}
