//! One seeded generator for test and benchmark data (xorshift64): the same
//! seed gives the same bytes on every platform, and no RNG crate is needed.

use bytes::Bytes;

/// A xorshift64 generator. Fast and deterministic; not for anything secret.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Xorshift {
    /// The current state (never zero). Saving it and resuming from it continues
    /// the same stream.
    pub state: u64,
}

impl Xorshift {
    /// A generator for `seed` (any value, zero included).
    pub fn new(seed: u64) -> Self {
        Xorshift {
            state: seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1,
        }
    }

    /// The next 64 bits.
    pub fn next_u64(&mut self) -> u64 {
        let mut x = self.state;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.state = x;
        x
    }

    /// Uniform in `[-1, 1)`, from the top 24 bits.
    pub fn next_signed_unit(&mut self) -> f32 {
        ((self.next_u64() >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }

    /// Fill `out` with the stream, 8 bytes (little-endian) per draw.
    pub fn fill(&mut self, out: &mut [u8]) {
        for w in out.chunks_mut(8) {
            let b = self.next_u64().to_le_bytes();
            w.copy_from_slice(&b[..w.len()]);
        }
    }
}

/// `len` bytes of the stream of `seed`: incompressible-looking, and no two seeds alike.
pub fn seeded_bytes(seed: u64, len: usize) -> Vec<u8> {
    let mut out = vec![0u8; len];
    Xorshift::new(seed).fill(&mut out);
    out
}

/// [`seeded_bytes`] as [`Bytes`].
pub fn pattern(seed: u64, len: usize) -> Bytes {
    seeded_bytes(seed, len).into()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn deterministic_and_distinct() {
        assert_eq!(seeded_bytes(7, 100), seeded_bytes(7, 100));
        assert_ne!(seeded_bytes(7, 100), seeded_bytes(8, 100));
        assert_eq!(seeded_bytes(7, 13)[..], seeded_bytes(7, 100)[..13]);
        let mut g = Xorshift::new(0);
        assert!((0..1000).all(|_| (-1.0..1.0).contains(&g.next_signed_unit())));
    }
}
