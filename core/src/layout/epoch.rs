//! Writer epochs: which incarnation of a job may commit and collect under a root.
//!
//! A job that opens a root for writing claims the next epoch by creating
//! `epochs/<epoch:020>.claim`. The claim records the checkpoints that were
//! valid when it was made; from then on, a checkpoint committed by an older
//! epoch counts only if the claim lists it. An old incarnation that is still
//! running (a *zombie*) therefore cannot add a checkpoint that a load of the new
//! one would pick, and it learns at its next commit or collection that it was
//! fenced ([`Error::Fenced`]).
//!
//! ```text
//! epochs/00000000000000000001.claim   {"epoch":1,"valid":[],...}
//! epochs/00000000000000000002.claim   {"epoch":2,"valid":["00000000000000000040-9f..."],...}
//! ```
//!
//! How strong a claim is depends on the store ([`ClaimStrength`]):
//! - **Atomic** where the store honours create-only puts (local disk, memory,
//!   S3 with `If-None-Match`): two claimants of one epoch cannot both win.
//! - **Best effort** elsewhere (Garage ignores conditional puts): the claimant
//!   reads its claim back and tries the next epoch when another nonce is
//!   there. Two claimants that put and read back within each other's round
//!   trip can both believe they won.
//!
//! A fenced writer checks the next epoch's claim before and after it publishes
//! a manifest, and at least every `lease / 2` while it deletes (see
//! [`Fence`]); a new epoch's first save waits until `lease` has passed since
//! its claim, so no delete of an old writer can land after it relies on what
//! is stored.

use std::collections::{BTreeSet, HashMap};
use std::sync::Mutex;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use futures::TryStreamExt;
use object_store::path::Path;
use object_store::{ObjectStore, ObjectStoreExt, PutMode, PutOptions, PutPayload};
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::layout::catalog;
use crate::layout::manifest::Manifest;
use crate::layout::paths;
use crate::model::CheckpointId;
use crate::sync::MutexExt;

/// Folder of epoch claims.
pub const EPOCHS: &str = "epochs";
const CLAIM_EXT: &str = ".claim";
/// Largest claim that is read (a claim lists the valid checkpoints' names).
pub const MAX_CLAIM_BYTES: u64 = 64 << 20;
const CLAIM_VERSION: u32 = 1;
/// Claims tried before giving up (each lost race moves to the next epoch).
const CLAIM_TRIES: u32 = 16;

/// How strongly a store's claims exclude each other.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub enum ClaimStrength {
    /// The store honours create-only puts: exactly one claimant wins an epoch.
    Atomic,
    /// The store may ignore create-only puts: a claim is read back and checked,
    /// which leaves a window of one round trip.
    BestEffort,
}

/// The record of one claimed epoch.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Claim {
    /// Schema version.
    pub version: u32,
    /// The epoch claimed.
    pub epoch: u64,
    /// Random value of the claimant (a claim read back with another nonce was lost).
    pub nonce: String,
    /// Wall-clock time of the claim, milliseconds since the Unix epoch.
    pub claimed_unix_ms: u64,
    /// Host name and process id of the claimant, for people reading a root.
    pub holder: String,
    /// How the claim was made.
    pub strength: ClaimStrength,
    /// Names (`<step>-<attempt>`) of the checkpoints valid when the claim was made.
    pub valid: BTreeSet<String>,
}

/// Key of an epoch's claim.
pub fn claim_key(epoch: u64) -> Path {
    Path::from(format!("{EPOCHS}/{epoch:020}{CLAIM_EXT}"))
}

/// The epoch a claim's key names, if it is one.
pub(crate) fn parse_claim_key(key: &Path) -> Option<u64> {
    let name = key.filename()?.strip_suffix(CLAIM_EXT)?;
    (name.len() == 20).then(|| name.parse().ok()).flatten()
}

impl Claim {
    fn encode(&self) -> Result<Vec<u8>> {
        serde_json::to_vec(self).map_err(|e| Error::Internal(format!("encode claim: {e}")))
    }

    fn decode(bytes: &[u8], key: &Path) -> Result<Claim> {
        let c: Claim = serde_json::from_slice(bytes)
            .map_err(|e| Error::corrupt(key.as_ref(), None, format!("bad epoch claim: {e}")))?;
        if c.version > CLAIM_VERSION {
            return Err(Error::Unsupported(format!(
                "epoch claim `{key}` has version {}; this build reads up to {CLAIM_VERSION}",
                c.version
            )));
        }
        if parse_claim_key(key) != Some(c.epoch) {
            return Err(Error::corrupt(
                key.as_ref(),
                None,
                format!("claim is for epoch {}", c.epoch),
            ));
        }
        Ok(c)
    }
}

/// The newest epoch claimed under a root (0: none yet).
pub async fn current(store: &dyn ObjectStore) -> Result<u64> {
    let prefix = Path::from(EPOCHS);
    let metas: Vec<_> = match store.list(Some(&prefix)).try_collect().await {
        Err(object_store::Error::NotFound { .. }) => Vec::new(),
        r => r?,
    };
    Ok(metas
        .iter()
        .filter_map(|m| parse_claim_key(&m.location))
        .max()
        .unwrap_or(0))
}

/// The claim of an epoch, `None` when it does not exist.
pub async fn read_claim(store: &dyn ObjectStore, epoch: u64) -> Result<Option<Claim>> {
    let key = claim_key(epoch);
    let r = match store.get(&key).await {
        Ok(r) => r,
        Err(object_store::Error::NotFound { .. }) => return Ok(None),
        Err(e) => return Err(e.into()),
    };
    if r.meta.size > MAX_CLAIM_BYTES {
        return Err(Error::corrupt(
            key.as_ref(),
            None,
            format!("claim of {} bytes exceeds the cap", r.meta.size),
        ));
    }
    let bytes = r.bytes().await?;
    Claim::decode(&bytes, &key).map(Some)
}

/// True when a claim of an epoch exists.
async fn exists(store: &dyn ObjectStore, epoch: u64) -> Result<bool> {
    match store.head(&claim_key(epoch)).await {
        Ok(_) => Ok(true),
        Err(object_store::Error::NotFound { .. }) => Ok(false),
        Err(e) => Err(e.into()),
    }
}

/// Which committed checkpoints count, as of the newest claim.
#[derive(Debug, Clone, Default)]
pub struct EpochView {
    /// The newest epoch claimed (0: none).
    pub current: u64,
    /// Its claim (`None` when there is none).
    pub claim: Option<Claim>,
}

/// What [`EpochView::judge`] says of a committed checkpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Verdict {
    /// It counts.
    Valid,
    /// It was committed by an older epoch after a newer one claimed the root.
    Zombie,
}

impl EpochView {
    /// Read the newest claim of a root.
    ///
    /// A claim that is damaged (truncated, not a claim) says nothing about
    /// which older checkpoints count: then every committed checkpoint counts,
    /// as on a root without claims. A damaged claim can thus let a zombie's
    /// checkpoint count, but never hides the job's own, and never stops a
    /// restart. Storage errors are returned.
    pub async fn read(store: &dyn ObjectStore) -> Result<EpochView> {
        let current = current(store).await?;
        if current == 0 {
            return Ok(EpochView::default());
        }
        let claim = match read_claim(store, current).await {
            Ok(c) => c,
            Err(e) if e.is_unusable() => {
                tracing::warn!(
                    "epoch claim {current} is unreadable ({e}); every committed checkpoint counts"
                );
                None
            }
            Err(e) => return Err(e),
        };
        Ok(EpochView { current, claim })
    }

    /// True when the verdict on `id` needs its manifest's epoch (it is not
    /// listed by the newest claim).
    pub fn needs_epoch(&self, id: &CheckpointId) -> bool {
        self.claim
            .as_ref()
            .is_some_and(|c| !c.valid.contains(&paths::checkpoint_name(id)))
    }

    /// Judge a committed checkpoint by its manifest's epoch.
    pub fn judge(&self, id: &CheckpointId, manifest_epoch: u64) -> Verdict {
        if !self.needs_epoch(id) || manifest_epoch >= self.current {
            Verdict::Valid
        } else {
            Verdict::Zombie
        }
    }
}

/// The epochs of the manifests already read. A published manifest never
/// changes and its id is never reused, so each is read once for its epoch.
#[derive(Debug, Default)]
pub struct ManifestEpochs(Mutex<HashMap<CheckpointId, u64>>);

impl ManifestEpochs {
    /// The epoch of `id`'s manifest: remembered, or read (and remembered).
    pub async fn of(&self, store: &dyn ObjectStore, id: &CheckpointId) -> Result<u64> {
        if let Some(e) = self.0.lock_unpoisoned().get(id) {
            return Ok(*e);
        }
        // The header line says it (256 bytes read); an older manifest's is read whole.
        let key = crate::layout::paths::manifest_key(id);
        let head = store.get_range(&key, 0..256).await;
        let e = match head.ok().and_then(|h| Manifest::header_epoch(&h)) {
            Some(e) => e,
            None => catalog::read_manifest(store, id).await?.epoch,
        };
        self.0.lock_unpoisoned().insert(id.clone(), e);
        Ok(e)
    }
}

/// The committed checkpoints that count under `view`, oldest first, and the
/// zombies among the rest. Needs the epochs of the manifests that the newest
/// claim does not list (those committed since), from `seen` or read; an
/// unreadable manifest counts as valid here (a load then finds it damaged,
/// and GC keeps its chunks).
pub async fn partition_committed(
    store: &dyn ObjectStore,
    view: &EpochView,
    seen: &ManifestEpochs,
) -> Result<(Vec<CheckpointId>, Vec<CheckpointId>)> {
    let ids = catalog::committed(store).await?;
    let mut valid = Vec::with_capacity(ids.len());
    let mut zombies = Vec::new();
    for id in ids {
        if !view.needs_epoch(&id) {
            valid.push(id);
            continue;
        }
        match seen.of(store, &id).await {
            Ok(e) if view.judge(&id, e) == Verdict::Zombie => zombies.push(id),
            Ok(_) | Err(_) => valid.push(id),
        }
    }
    Ok((valid, zombies))
}

/// An epoch this process holds.
#[derive(Debug, Clone)]
pub struct Claimed {
    /// The epoch.
    pub epoch: u64,
    /// When it was claimed (this process's clock).
    pub at: Instant,
    /// False when the root had no earlier epoch: no older writer can be
    /// deleting, so the first save need not wait out the lease.
    pub had_predecessor: bool,
}

/// Claim the next epoch of a root for a writer with `nonce`.
///
/// Errors: storage errors; [`Error::Conflict`] when `CLAIM_TRIES` claims in a
/// row were lost to other claimants.
pub async fn claim_next(
    store: &dyn ObjectStore,
    nonce: &str,
    strength: ClaimStrength,
) -> Result<Claimed> {
    for _ in 0..CLAIM_TRIES {
        let view = EpochView::read(store).await?;
        // The checkpoints valid now are those the new claim keeps valid.
        let (valid, _) = partition_committed(store, &view, &ManifestEpochs::default()).await?;
        let epoch = view.current + 1;
        let at = Instant::now();
        if try_claim(store, nonce, strength, epoch, &valid).await? {
            tracing::info!("claimed writer epoch {epoch} ({strength:?})");
            return Ok(Claimed {
                epoch,
                at,
                had_predecessor: view.current > 0,
            });
        }
    }
    Err(Error::Conflict(format!(
        "could not claim a writer epoch in {CLAIM_TRIES} tries: other writers claim this root at the same time"
    )))
}

/// Claim the epoch after `held` for the writer that holds `held`, keeping
/// valid only the checkpoints valid now that `keep` accepts: the others
/// become a fenced writer's, which loads pass over and GC retires. One
/// create-only put decides, so the change is whole or absent after a crash.
/// The writer carries on under the new epoch.
///
/// Errors: [`Error::Fenced`] when another writer has claimed since `held`
/// (that claim wins: nothing changes); storage errors.
pub async fn claim_successor(
    store: &dyn ObjectStore,
    nonce: &str,
    strength: ClaimStrength,
    held: u64,
    keep: impl Fn(&CheckpointId) -> bool,
) -> Result<u64> {
    let view = EpochView::read(store).await?;
    let fenced = |current: u64| Error::Fenced {
        epoch: held,
        current: current.max(held + 1),
    };
    if view.current != held {
        return Err(fenced(view.current));
    }
    let (valid, _) = partition_committed(store, &view, &ManifestEpochs::default()).await?;
    let kept: Vec<CheckpointId> = valid.into_iter().filter(|id| keep(id)).collect();
    let won = match try_claim(store, nonce, strength, held + 1, &kept).await {
        Ok(won) => won,
        // The put may have landed with only its read-back failing: a claim
        // of this writer's that it did not carry on under would fence it.
        Err(e) => match read_claim(store, held + 1).await {
            Ok(Some(c)) if c.nonce == nonce => true,
            _ => return Err(e),
        },
    };
    if won {
        tracing::info!(
            "claimed writer epoch {} after {held} ({strength:?})",
            held + 1
        );
        return Ok(held + 1);
    }
    Err(fenced(current(store).await?))
}

/// Put the claim of `epoch` listing `valid`, create-only where the store
/// supports it, and read it back: true when this claimant (`nonce`) holds it.
async fn try_claim(
    store: &dyn ObjectStore,
    nonce: &str,
    strength: ClaimStrength,
    epoch: u64,
    valid: &[CheckpointId],
) -> Result<bool> {
    let claim = Claim {
        version: CLAIM_VERSION,
        epoch,
        nonce: nonce.to_owned(),
        claimed_unix_ms: SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default()
            .as_millis() as u64,
        holder: holder(),
        strength,
        valid: valid.iter().map(paths::checkpoint_name).collect(),
    };
    let key = claim_key(epoch);
    let opts = PutOptions {
        mode: PutMode::Create,
        ..Default::default()
    };
    match store
        .put_opts(&key, PutPayload::from(claim.encode()?), opts)
        .await
    {
        Ok(_) => {}
        Err(object_store::Error::AlreadyExists { .. }) => return Ok(false),
        Err(object_store::Error::NotImplemented { .. }) => {
            // No create-only put at all: plain put, then the read-back decides.
            if exists(store, epoch).await? {
                return Ok(false);
            }
            store.put(&key, PutPayload::from(claim.encode()?)).await?;
        }
        Err(e) => return Err(e.into()),
    }
    // Read back: on a store that ignored the create-only mode, a later
    // claimant may have overwritten this claim.
    Ok(matches!(read_claim(store, epoch).await?, Some(c) if c.nonce == nonce))
}

fn holder() -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_owned())
        .unwrap_or_else(|_| "?".into());
    format!("{host}:{}", std::process::id())
}

/// The check a fenced writer makes before it acts: has a newer epoch claimed
/// the root?
#[derive(Debug, Clone)]
pub struct Fence {
    /// The writer's epoch.
    pub epoch: u64,
    /// The lease: an old writer acts at most `lease / 2` after its last check,
    /// and a new epoch's first save waits `lease` after its claim.
    pub lease: Duration,
    checked: Option<Instant>,
}

impl Fence {
    /// A fence for a writer of `epoch`.
    pub fn new(epoch: u64, lease: Duration) -> Fence {
        Fence {
            epoch,
            lease,
            checked: None,
        }
    }

    /// Fail with [`Error::Fenced`] when a newer epoch has claimed the root.
    pub async fn check(&mut self, store: &dyn ObjectStore) -> Result<()> {
        if exists(store, self.epoch + 1).await? {
            let current = current(store).await?.max(self.epoch + 1);
            return Err(Error::Fenced {
                epoch: self.epoch,
                current,
            });
        }
        self.checked = Some(Instant::now());
        Ok(())
    }

    /// Check again unless the last check is recent (within `lease / 2`).
    pub async fn recheck(&mut self, store: &dyn ObjectStore) -> Result<()> {
        match self.checked {
            Some(t) if t.elapsed() < self.lease / 2 => Ok(()),
            _ => self.check(store).await,
        }
    }

    /// After a publish: fail with [`Error::Fenced`] when a newer epoch has
    /// claimed the root and its claim does not count the manifest of `id`
    /// (published too late: loads ignore it).
    pub async fn confirm(&mut self, store: &dyn ObjectStore, id: &CheckpointId) -> Result<()> {
        let next = match read_claim(store, self.epoch + 1).await {
            // A newer claim exists but cannot be read: fenced all the same.
            Err(e) if e.is_unusable() => {
                return Err(Error::Fenced {
                    epoch: self.epoch,
                    current: self.epoch + 1,
                })
            }
            r => r?,
        };
        match next {
            None => {
                self.checked = Some(Instant::now());
                Ok(())
            }
            // Published before the claim listed what counts: the checkpoint
            // counts, and the next check fences this writer.
            Some(c) if c.valid.contains(&paths::checkpoint_name(id)) => Ok(()),
            Some(c) => Err(Error::Fenced {
                epoch: self.epoch,
                current: c.epoch,
            }),
        }
    }
}
