//! What one save reports: where its time and bytes went.

use std::time::Duration;

use crate::layout::retention::GcReport;
use crate::model::CheckpointId;

/// Where the time and bytes of one save went.
#[derive(Debug, Clone, Default)]
pub struct SaveReport {
    /// The committed checkpoint.
    pub id: CheckpointId,
    /// Time `save` kept the caller waiting.
    pub stall: Duration,
    /// Time of the snapshot copy (in lazy mode, mostly after `save` returned).
    pub snapshot: Duration,
    /// Wall time from the end of the snapshot to the commit.
    pub persist: Duration,
    /// Time to publish the manifest.
    pub commit: Duration,
    /// Wall time from the call of `save` to the commit.
    pub total: Duration,
    /// CPU time spent hashing, summed over tasks.
    pub hash_cpu: Duration,
    /// CPU time spent encoding and compressing, summed over tasks.
    pub encode_cpu: Duration,
    /// Time spent in storage writes, summed over tasks.
    pub write_io: Duration,
    /// Raw tensor bytes in the checkpoint.
    pub raw_bytes: u64,
    /// Bytes copied by the snapshot.
    pub copied_bytes: u64,
    /// Bytes written to storage.
    pub stored_bytes: u64,
    /// Raw bytes not written because identical chunks were already stored.
    pub reused_bytes: u64,
    /// Objects written (manifest included).
    pub objects: u64,
    /// What GC did after this commit, if it ran.
    pub gc: Option<GcReport>,
}
