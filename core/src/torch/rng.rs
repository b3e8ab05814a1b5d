//! Deterministic random state for resumable loops.
//!
//! tch gives no access to the state of torch's generators (only `manual_seed`), so a
//! checkpoint cannot hold it. Instead a resumable loop reseeds torch's CPU and CUDA
//! generators at the start of every step from the run's seed and the step number
//! ([`reseed`]); everything random in that step (data, dropout, noise) then depends
//! only on `(seed, step)`, and a restarted loop that reseeds the same way draws the
//! same numbers. The checkpoint stores the seed and the step as plain data.

/// The seed of step `step` of a run seeded with `seed` (SplitMix64 of both), so
/// nearby steps get unrelated streams.
pub fn step_seed(seed: u64, step: u64) -> u64 {
    let mut z = seed ^ step.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Reseed torch's CPU generator, and every CUDA generator when CUDA is available,
/// for step `step` of a run seeded with `seed`.
pub fn reseed(seed: u64, step: u64) {
    let s = step_seed(seed, step);
    // torch takes the seed as a signed 64-bit value; keep it non-negative.
    tch::manual_seed((s >> 1) as i64);
    if tch::Cuda::is_available() {
        tch::Cuda::manual_seed_all(s >> 1);
    }
}
