//! What a store is good at, so that the engine adapts to the store it is given
//! instead of guessing from a URL's prefix.

use crate::layout::epoch::ClaimStrength;
use crate::tiered::{TieredUrl, SCHEME_PREFIX};

/// Ranged reads of a single-file format closer than this are merged into one
/// request on a remote store (one request costs a round trip; the gap bytes
/// are cheap beside it).
pub const REMOTE_COALESCE_BYTES: u64 = crate::format::ranges::MAX_SPAN;

/// The capabilities of a store.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct Capabilities {
    /// Create-only puts (`PutMode::Create`) are honoured: of two puts of one
    /// key, exactly one succeeds. Writer epochs are then claimed atomically;
    /// otherwise a claim is read back (best effort).
    pub atomic_create: bool,
    /// Ranged reads of single-file formats whose gap is at most this many
    /// bytes are merged into one request (0: each range its own request).
    pub coalesce_bytes: u64,
    /// Large puts bypass the page cache (`O_DIRECT`).
    pub direct_io: bool,
}

impl Capabilities {
    /// What every store can be relied on for: nothing beyond plain puts and gets.
    pub const fn conservative() -> Self {
        Capabilities {
            atomic_create: false,
            coalesce_bytes: 0,
            direct_io: false,
        }
    }

    /// A local directory: atomic creates (link), ranges read at local cost.
    pub const fn local_dir(direct_io: bool) -> Self {
        Capabilities {
            atomic_create: true,
            coalesce_bytes: 0,
            direct_io,
        }
    }

    /// The in-process memory store.
    pub const fn memory() -> Self {
        Capabilities {
            atomic_create: true,
            coalesce_bytes: 0,
            direct_io: false,
        }
    }

    /// An S3-compatible server; `atomic_create` when it honours `If-None-Match`
    /// (AWS S3 does; Garage ignores it).
    pub const fn s3(atomic_create: bool) -> Self {
        Capabilities {
            atomic_create,
            coalesce_bytes: REMOTE_COALESCE_BYTES,
            direct_io: false,
        }
    }

    /// A tiered store: epoch claims go to the durable tier, so its atomicity
    /// counts; reads that miss the fast tier go to the durable one, so its
    /// coalescing counts.
    pub const fn tiered(fast: Capabilities, durable: Capabilities) -> Self {
        Capabilities {
            atomic_create: durable.atomic_create,
            coalesce_bytes: durable.coalesce_bytes,
            direct_io: fast.direct_io,
        }
    }

    /// How writer epochs are claimed on this store.
    pub fn claim_strength(&self) -> ClaimStrength {
        if self.atomic_create {
            ClaimStrength::Atomic
        } else {
            ClaimStrength::BestEffort
        }
    }

    /// The capabilities of the store a URL opens ([`super::open_url`]).
    pub fn of_url(url: &str) -> Capabilities {
        if url.starts_with(SCHEME_PREFIX) {
            return match TieredUrl::parse(url) {
                Ok(u) => Capabilities::tiered(Self::of_url(&u.fast), Self::of_url(&u.durable)),
                Err(_) => Capabilities::conservative(),
            };
        }
        match url.split_once("://") {
            None | Some(("file", _)) => Capabilities::local_dir(
                super::LocalDirOptions::default()
                    .with_env_override()
                    .direct_min_bytes
                    .is_some(),
            ),
            Some(("memory", _)) => Capabilities::memory(),
            Some(("s3", _)) => Capabilities::s3(super::s3::conditional_put_from_env()),
            Some(_) => Capabilities::conservative(),
        }
    }
}

impl Default for Capabilities {
    fn default() -> Self {
        Capabilities::conservative()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_say_what_their_stores_do() {
        assert!(Capabilities::of_url("memory://x").atomic_create);
        assert!(Capabilities::of_url("/tmp/x").atomic_create);
        assert_eq!(Capabilities::of_url("/tmp/x").coalesce_bytes, 0);
        let s3 = Capabilities::of_url("s3://b/p");
        assert_eq!(s3.coalesce_bytes, REMOTE_COALESCE_BYTES);
        // A tiered root over S3 reads like S3 on a miss and claims on S3.
        let t = Capabilities::of_url("tiered+memory://f?durable=s3://b/p");
        assert_eq!(t.coalesce_bytes, REMOTE_COALESCE_BYTES);
        assert_eq!(t.atomic_create, s3.atomic_create);
        assert!(!Capabilities::conservative().atomic_create);
    }
}
