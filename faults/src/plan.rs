//! The seeded plan of a campaign: which failure comes next, and its parameters.
//!
//! Everything random in a campaign is drawn from one [`Rng`] seeded by the
//! campaign's seed, in the order the campaign asks, so the same seed injects the
//! same failures at the same places (the instants of SIGKILLs at random times
//! still depend on how fast the machine is).

use serde::Serialize;

/// SplitMix64: small, fast, and good enough to spread failures.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    /// A generator seeded with `seed`.
    pub fn new(seed: u64) -> Self {
        Rng(seed ^ 0x6A09_E667_F3BC_C908)
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `lo..=hi` (`lo` when `hi < lo`).
    pub fn range(&mut self, lo: u64, hi: u64) -> u64 {
        if hi <= lo {
            return lo;
        }
        lo + self.next_u64() % (hi - lo + 1)
    }

    /// Uniform in `[0, 1)`.
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// One element of a non-empty slice.
    pub fn pick<'a, T>(&mut self, xs: &'a [T]) -> &'a T {
        &xs[self.range(0, xs.len() as u64 - 1) as usize]
    }

    /// An index drawn with the given weights (not all zero).
    pub fn weighted(&mut self, weights: &[u64]) -> usize {
        let total: u64 = weights.iter().sum();
        let mut x = self.range(0, total.saturating_sub(1));
        for (i, w) in weights.iter().enumerate() {
            if x < *w {
                return i;
            }
            x -= w;
        }
        weights.len() - 1
    }

    /// A generator for a sub-plan, independent of how much this one is used later.
    pub fn fork(&mut self) -> Rng {
        Rng(self.next_u64())
    }
}

/// The kinds of failure a campaign injects.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Kind {
    /// SIGKILL of the training process at a random instant (a random step plus a
    /// random delay of up to 3 ms, so it lands inside saves as well as between them).
    Kill,
    /// The process aborts exactly at a failpoint of a save (`CKPT_FAILPOINTS=P=N*abort`).
    Crash,
    /// A save is parked at a failpoint (`P=N*sleep`) and the process is SIGKILLed there.
    Parked,
    /// A stored object (manifest, chunk, shared chunk, any object) gets a bit flipped,
    /// is truncated or is deleted while the job is down.
    Corrupt,
    /// The job runs on a store that injects errors, timeouts, partial writes and lost
    /// acknowledgements (FaultStore under a RetryStore), and is SIGKILLed on the way.
    StoreFaults,
    /// The disk fills up (a small tmpfs with ballast, or FaultStore failing every
    /// write where mounting is refused); space is freed before the restart.
    DiskFull,
    /// The job is frozen (SIGSTOP) at a random instant, a new incarnation
    /// starts on the same root, and the old one is resumed (SIGCONT) while the
    /// new one trains: a zombie that goes on saving and collecting. It must be
    /// fenced: nothing it commits is loaded, nothing the new one keeps is lost.
    Zombie,
    /// One rank of `mpi_ckpt` under mpirun is SIGKILLed mid-save; the newest
    /// checkpoint then loads, verified bitwise, into another number of ranks.
    MpiRank,
    /// One rank of the data-parallel `mpi_train` example is SIGKILLed; the job restarts
    /// with the same ranks and must end with the straight run's weights.
    MpiTrain,
}

impl Kind {
    /// Every kind, in report order.
    pub const ALL: [Kind; 9] = [
        Kind::Kill,
        Kind::Crash,
        Kind::Parked,
        Kind::Corrupt,
        Kind::StoreFaults,
        Kind::DiskFull,
        Kind::Zombie,
        Kind::MpiRank,
        Kind::MpiTrain,
    ];

    /// The name used on the command line and in reports.
    pub fn name(self) -> &'static str {
        match self {
            Kind::Kill => "kill",
            Kind::Crash => "crash",
            Kind::Parked => "parked",
            Kind::Corrupt => "corrupt",
            Kind::StoreFaults => "store-faults",
            Kind::DiskFull => "disk-full",
            Kind::Zombie => "zombie",
            Kind::MpiRank => "mpi-rank",
            Kind::MpiTrain => "mpi-train",
        }
    }

    /// Parse a name of [`Kind::name`].
    pub fn parse(s: &str) -> Option<Kind> {
        Kind::ALL.into_iter().find(|k| k.name() == s)
    }

    /// Relative frequency in a campaign.
    pub fn weight(self) -> u64 {
        match self {
            Kind::Kill => 24,
            Kind::Crash => 16,
            Kind::Parked => 14,
            Kind::Corrupt => 24,
            Kind::StoreFaults => 10,
            Kind::DiskFull => 6,
            Kind::Zombie => 12,
            Kind::MpiRank => 3,
            Kind::MpiTrain => 3,
        }
    }

    /// True for the kinds that run under mpirun, outside the tch job.
    pub fn is_mpi(self) -> bool {
        matches!(self, Kind::MpiRank | Kind::MpiTrain)
    }
}

/// The save failpoints, in the order a save passes them (ckpt-core's list).
pub use ckpt_core::failpoint::NAMES as SAVE_POINTS;

/// True when a crash at this failpoint happens before the manifest is published.
pub fn before_commit(point: &str) -> bool {
    !matches!(point, "save.after_manifest" | "gc.before_delete")
}

/// What gets damaged by a [`Kind::Corrupt`] failure.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Target {
    /// The manifest of the newest committed checkpoint.
    NewestManifest,
    /// A chunk that only the newest checkpoint uses.
    NewestChunk,
    /// A chunk every checkpoint shares (the frozen layer).
    SharedChunk,
    /// Any object under the root.
    AnyObject,
}

/// How it is damaged.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Action {
    /// One bit flipped.
    FlipBit,
    /// Cut to a shorter length.
    Truncate,
    /// Removed.
    Delete,
}

/// Draw a corruption.
pub fn corruption(rng: &mut Rng) -> (Target, Action) {
    let t = [
        Target::NewestManifest,
        Target::NewestChunk,
        Target::SharedChunk,
        Target::AnyObject,
    ][rng.weighted(&[25, 35, 15, 25])];
    let a = [Action::FlipBit, Action::Truncate, Action::Delete][rng.weighted(&[40, 30, 30])];
    (t, a)
}

/// The kinds of a campaign in the order it meets them: first every enabled kind
/// once (so a small campaign covers them all), then draws by weight.
pub struct KindStream {
    kinds: Vec<Kind>,
    forced: Vec<Kind>,
}

impl KindStream {
    /// A stream over `kinds` (deduplicated, in [`Kind::ALL`] order).
    pub fn new(kinds: &[Kind]) -> Self {
        let mut kinds: Vec<Kind> = Kind::ALL
            .into_iter()
            .filter(|k| kinds.contains(k))
            .collect();
        kinds.dedup();
        let mut forced = kinds.clone();
        forced.reverse();
        KindStream { kinds, forced }
    }

    /// The next kind.
    pub fn next(&mut self, rng: &mut Rng) -> Option<Kind> {
        if let Some(k) = self.forced.pop() {
            return Some(k);
        }
        if self.kinds.is_empty() {
            return None;
        }
        let w: Vec<u64> = self.kinds.iter().map(|k| k.weight()).collect();
        Some(self.kinds[rng.weighted(&w)])
    }

    /// Put a kind back to be drawn again next (it could not be used yet).
    pub fn push_back(&mut self, k: Kind) {
        self.forced.push(k);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_seed_same_draws() {
        let draw = |seed| {
            let mut r = Rng::new(seed);
            let mut s = KindStream::new(&Kind::ALL);
            (0..50)
                .map(|_| (s.next(&mut r).unwrap(), r.range(1, 40)))
                .collect::<Vec<_>>()
        };
        assert_eq!(draw(7), draw(7));
        assert_ne!(draw(7), draw(8));
        // The first draws cover every kind once.
        let first: Vec<Kind> = draw(3).into_iter().take(9).map(|(k, _)| k).collect();
        assert_eq!(first, Kind::ALL.to_vec());
    }

    #[test]
    fn ranges_and_weights_stay_in_bounds() {
        let mut r = Rng::new(1);
        let mut seen = [0u32; 3];
        for _ in 0..3000 {
            let x = r.range(3, 5);
            assert!((3..=5).contains(&x));
            seen[r.weighted(&[1, 0, 3])] += 1;
        }
        assert_eq!(seen[1], 0);
        assert!(seen[2] > seen[0]);
        assert_eq!(r.range(9, 2), 9);
    }
}
