//! The order of a job's saves: every rank numbers its saves alike, derives
//! the same attempt id from the number, and runs the collective part of each
//! save in that order.

use std::sync::atomic::{AtomicU64, Ordering};

use tokio::sync::watch;

use crate::model::CheckpointId;

/// The saves of a job, in the order they were started.
#[derive(Debug)]
pub(crate) struct Turns {
    /// A random value every rank of the job shares (agreed at build time).
    nonce: String,
    /// Saves started (that reached the persist phase); every rank counts the same.
    started: AtomicU64,
    /// The sequence number whose turn it is to run the collective part of a save.
    turn: watch::Sender<u64>,
}

/// The turn of one save; dropping it passes the turn on, whatever happened.
pub(crate) struct Turn<'a> {
    tx: &'a watch::Sender<u64>,
    seq: u64,
}

impl Turns {
    /// No save started yet; attempt ids derived from `nonce`.
    pub fn new(nonce: String) -> Turns {
        Turns {
            nonce,
            started: AtomicU64::new(0),
            turn: watch::channel(0).0,
        }
    }

    /// Number a new save of `step`: its sequence number, and the id it will
    /// commit (the same on every rank).
    pub fn start(&self, step: u64) -> (u64, CheckpointId) {
        let seq = self.started.fetch_add(1, Ordering::SeqCst);
        let id = CheckpointId {
            step,
            attempt: attempt_id(&self.nonce, step, seq),
        };
        (seq, id)
    }

    /// Wait until the saves started before the `seq`-th have had their turn.
    pub async fn take(&self, seq: u64) -> Turn<'_> {
        let mut rx = self.turn.subscribe();
        // The sender lives in `self`, so this cannot fail.
        let _ = rx.wait_for(|t| *t >= seq).await;
        Turn {
            tx: &self.turn,
            seq,
        }
    }
}

impl Drop for Turn<'_> {
    fn drop(&mut self) {
        let next = self.seq + 1;
        self.tx.send_modify(|t| *t = (*t).max(next));
    }
}

/// The attempt id of the `seq`-th save of a job: the same on every rank.
fn attempt_id(nonce: &str, step: u64, seq: u64) -> String {
    let mut h = blake3::Hasher::new();
    h.update(nonce.as_bytes());
    h.update(&step.to_le_bytes());
    h.update(&seq.to_le_bytes());
    h.finalize().to_hex()[..16].to_owned()
}
