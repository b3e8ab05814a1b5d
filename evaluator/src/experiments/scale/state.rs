//! The simulated ranks' state: FSDP-like sharded tensors, replicated tensors
//! and one rank-local tensor per rank, tiny and made from a seed, so that
//! what a load returns can be checked against what any split of it must hold.

use ckpt_core::{DType, ShardSpec, State, Tensor};

/// Rows of a sharded tensor each rank holds.
pub const ROWS: u64 = 4;
/// Columns of every sharded tensor.
pub const COLS: u64 = 8;
/// Bytes of a rank-local tensor.
pub const LOCAL: u64 = 16;

/// The shape of every rank's state.
#[derive(Debug, Clone, Copy, serde::Serialize)]
pub struct Shape {
    /// Sharded tensors (global `[ranks * ROWS, COLS]` f32, rank `r` holding
    /// rows `[ROWS * r, ROWS * (r + 1))`).
    pub sharded: usize,
    /// Tensors every rank holds whole, the same on every rank.
    pub replicated: usize,
}

fn mix(mut x: u64) -> u64 {
    // splitmix64's finaliser.
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// Bytes of elements `range` of tensor number `tensor`, as saved with `seed`.
fn words(seed: u64, tensor: u64, range: std::ops::Range<u64>) -> Vec<u8> {
    let base = mix(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ tensor);
    range
        .flat_map(|i| (mix(base ^ i) as u32).to_le_bytes())
        .collect()
}

/// Name of sharded tensor `i`.
pub fn sharded_name(i: usize) -> String {
    format!("layer{i}.weight")
}

/// Name of replicated tensor `j`.
pub fn replicated_name(j: usize) -> String {
    format!("replicated{j}")
}

/// Name of rank `r`'s own tensor: under the rank's own prefix, as the
/// Python layer names a rank's RNG state, so that every rank's table of what
/// it holds is alike (the plan then exchanges one table, not one per rank).
pub fn local_name(r: usize) -> String {
    format!("{}.rng", ckpt_core::layout::pymeta::own_name(r as u64))
}

/// Rows `rows` of sharded tensor `i` (every column).
pub fn sharded_rows(seed: u64, i: usize, rows: std::ops::Range<u64>) -> Vec<u8> {
    words(seed, i as u64, rows.start * COLS..rows.end * COLS)
}

/// Replicated tensor `j` (`COLS` f32).
pub fn replicated(seed: u64, j: usize) -> Vec<u8> {
    words(seed, (1 << 32) + j as u64, 0..COLS)
}

/// Rank `r`'s own tensor (`LOCAL` bytes).
pub fn local(seed: u64, r: usize) -> Vec<u8> {
    let mut b = words(seed, (2 << 32) + r as u64, 0..LOCAL / 4);
    b.truncate(LOCAL as usize);
    b
}

/// Global shape of every sharded tensor in a job of `ranks`.
pub fn global(ranks: usize) -> Vec<u64> {
    vec![ranks as u64 * ROWS, COLS]
}

/// What rank `r` of `ranks` saves with `seed`.
pub fn of_rank(shape: Shape, r: usize, ranks: usize, seed: u64) -> Result<State, ckpt_core::Error> {
    let mut s = State::new();
    let rows = r as u64 * ROWS..(r as u64 + 1) * ROWS;
    for i in 0..shape.sharded {
        let t = Tensor::new(
            sharded_name(i),
            DType::F32,
            vec![ROWS, COLS],
            sharded_rows(seed, i, rows.clone()),
        )?
        .with_shard(ShardSpec {
            global_shape: global(ranks),
            offsets: vec![rows.start, 0],
        })?;
        s = s.with_tensor(t);
    }
    for j in 0..shape.replicated {
        s = s.with_tensor(Tensor::new(
            replicated_name(j),
            DType::F32,
            vec![COLS],
            replicated(seed, j),
        )?);
    }
    Ok(s.with_tensor(Tensor::new(
        local_name(r),
        DType::U8,
        vec![LOCAL],
        local(seed, r),
    )?))
}

/// Bytes of one rank's state.
pub fn rank_bytes(shape: Shape) -> u64 {
    (shape.sharded as u64 * ROWS * COLS + shape.replicated as u64 * COLS) * 4 + LOCAL
}

/// One box a loading rank asks for, and the bytes it must receive.
#[derive(Debug, Clone)]
pub struct Want {
    /// Tensor name.
    pub name: String,
    /// Its dtype.
    pub dtype: DType,
    /// The box's extent.
    pub shape: Vec<u64>,
    /// The global shape and the box's offsets.
    pub spec: ShardSpec,
    /// What it must hold.
    pub expect: Vec<u8>,
}

fn whole(name: String, dtype: DType, len: u64, expect: Vec<u8>) -> Want {
    Want {
        name,
        dtype,
        shape: vec![len],
        spec: ShardSpec {
            global_shape: vec![len],
            offsets: vec![0],
        },
        expect,
    }
}

/// What loading rank `q` of a job of `loaders` ranks asks of a checkpoint
/// that `saved` ranks wrote with `seed` (`saved` a multiple of `loaders`):
/// its box of every sharded tensor (`saved / loaders` old pieces), every
/// replicated tensor, and the own tensors of the old ranks it replaces.
pub fn wants(shape: Shape, q: usize, loaders: usize, saved: usize, seed: u64) -> Vec<Want> {
    let per = (saved / loaders.max(1)).max(1);
    let rows = (q * per) as u64 * ROWS..((q + 1) * per) as u64 * ROWS;
    let mut w: Vec<Want> = (0..shape.sharded)
        .map(|i| Want {
            name: sharded_name(i),
            dtype: DType::F32,
            shape: vec![rows.end - rows.start, COLS],
            spec: ShardSpec {
                global_shape: global(saved),
                offsets: vec![rows.start, 0],
            },
            expect: sharded_rows(seed, i, rows.clone()),
        })
        .collect();
    for j in 0..shape.replicated {
        w.push(whole(
            replicated_name(j),
            DType::F32,
            COLS,
            replicated(seed, j),
        ));
    }
    for r in q * per..(q + 1) * per {
        w.push(whole(local_name(r), DType::U8, LOCAL, local(seed, r)));
    }
    w
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_loader_of_half_the_ranks_wants_two_old_pieces_and_two_own_tensors() {
        let shape = Shape {
            sharded: 2,
            replicated: 1,
        };
        let saved: Vec<State> = (0..4).map(|r| of_rank(shape, r, 4, 9).unwrap()).collect();
        assert_eq!(saved[0].nbytes(), rank_bytes(shape));
        let w = wants(shape, 1, 2, 4, 9);
        assert_eq!(w.len(), 2 + 1 + 2);
        // Rows 8..16 of layer0 are ranks 2 and 3's pieces, in order.
        let mut both = saved[2].tensor("layer0.weight").unwrap().data.to_vec();
        both.extend_from_slice(&saved[3].tensor("layer0.weight").unwrap().data);
        assert_eq!(w[0].expect, both);
        assert_eq!(w[0].spec.offsets, vec![8, 0]);
        assert_eq!(
            w[2].expect,
            &saved[0].tensor("replicated0").unwrap().data[..]
        );
        assert_eq!(w[3].name, "__rank2__.rng");
        assert_eq!(
            w[4].expect,
            &saved[3].tensor(&local_name(3)).unwrap().data[..]
        );
        // Another seed, other bytes.
        assert_ne!(wants(shape, 1, 2, 4, 10)[0].expect, both);
    }
}
