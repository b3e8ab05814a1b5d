//! The one error type of `ckpt-core`.

use std::fmt;

mod verdict;
pub(crate) mod wire;

pub use verdict::{verdict, Verdict};

/// Result alias used throughout ckpt.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong in ckpt.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// No checkpoint (or no object) where one was asked for.
    #[error("not found: {what}")]
    NotFound {
        /// What was looked for.
        what: String,
    },

    /// Stored data failed verification: a hash mismatch, a truncated or
    /// unreadable object, or a manifest that does not parse.
    #[error("corrupt checkpoint data in object `{object}`{}: {reason}", tensor.as_ref().map(|t| format!(" (tensor `{t}`)")).unwrap_or_default())]
    Corrupt {
        /// The stored object (key relative to the checkpoint root).
        object: String,
        /// The tensor it belongs to, when known.
        tensor: Option<String>,
        /// What was wrong.
        reason: String,
    },

    /// A save would overwrite something that is already committed.
    #[error("conflict: {0}")]
    Conflict(String),

    /// This writer's epoch is over: a newer incarnation of the job claimed the
    /// root. The save published nothing that loads would pick, and nothing was
    /// deleted; this process should stop writing.
    #[error("fenced: this writer holds epoch {epoch}, but epoch {current} has claimed the root since; nothing was published or deleted (the claimant: a newer incarnation of this job, another job on this root, or a checkpointer opened on it to load that should have been read-only: `read_only=True`, `CheckpointerBuilder::read_only`)")]
    Fenced {
        /// The epoch this writer holds.
        epoch: u64,
        /// The newest epoch claimed.
        current: u64,
    },

    /// The caller passed something ckpt cannot use (bad shape, bad URL, bad option).
    #[error("invalid input: {0}")]
    InvalidInput(String),

    /// A stored format that ckpt does not understand (unknown version, unknown format name).
    #[error("unsupported: {0}")]
    Unsupported(String),

    /// The storage backend failed.
    #[error("storage error: {0}")]
    Storage(#[from] object_store::Error),

    /// A local I/O error outside the object store.
    #[error("i/o error: {0}")]
    Io(#[from] std::io::Error),

    /// An operation did not finish in time.
    #[error("timed out: {0}")]
    Timeout(String),

    /// A collective did not complete within `collective_timeout` because
    /// some ranks were not taking part in it: they arrived too late, never
    /// came (a dead or hung process), or were busy elsewhere. `ranks` names
    /// them (a roll call through the checkpoint store, [`crate::coord::RollCall`]);
    /// every rank that waited reports the same kind of error.
    #[error("timed out: {what} did not complete within {timeout_ms} ms: {} of {world} ranks were not taking part: {}", ranks.len(), list_ranks(ranks))]
    Stragglers {
        /// The collective and where in a save or load it was.
        what: String,
        /// The ranks that were not waiting in a collective when it timed out, ascending.
        ranks: Vec<usize>,
        /// The job's number of ranks.
        world: usize,
        /// The collective timeout, in milliseconds.
        timeout_ms: u64,
    },

    /// A save was refused because the staging budget was spent and the
    /// busy policy says to skip.
    #[error("checkpoint for step {step} skipped: {reason}")]
    Skipped {
        /// The step that was not saved.
        step: u64,
        /// Why.
        reason: String,
    },

    /// A background task failed in a way that left no more specific error.
    #[error("internal error: {0}")]
    Internal(String),
}

/// Ranks for a message: all of them up to 16, then how many more.
fn list_ranks(ranks: &[usize]) -> String {
    const SHOWN: usize = 16;
    let mut s = ranks
        .iter()
        .take(SHOWN)
        .map(usize::to_string)
        .collect::<Vec<_>>()
        .join(", ");
    if ranks.len() > SHOWN {
        s.push_str(&format!(" and {} more", ranks.len() - SHOWN));
    }
    s
}

impl Error {
    /// Shorthand for a [`Error::Corrupt`] error.
    pub fn corrupt(
        object: impl Into<String>,
        tensor: Option<&str>,
        reason: impl Into<String>,
    ) -> Self {
        Error::Corrupt {
            object: object.into(),
            tensor: tensor.map(str::to_owned),
            reason: reason.into(),
        }
    }

    /// The error with `phase` (say, `save of step 40, plan`) named in
    /// front of the collective a [`Error::Stragglers`] names; others unchanged.
    pub fn during(self, phase: impl fmt::Display) -> Error {
        match self {
            Error::Stragglers {
                what,
                ranks,
                world,
                timeout_ms,
            } => Error::Stragglers {
                what: format!("{phase}, {what}"),
                ranks,
                world,
                timeout_ms,
            },
            e => e,
        }
    }

    /// True when the error says that stored data is damaged or missing, as opposed to
    /// a transient or caller error. `load_latest` falls back past such checkpoints.
    ///
    /// Stored data this build cannot read ([`Error::Unsupported`]: a newer
    /// ckpt's manifest, a format built out) is not damage: a load that fell
    /// back past it would resume an older checkpoint, and the job's saves
    /// and retention would then bury the newer one.
    pub fn is_damage(&self) -> bool {
        matches!(
            self,
            Error::Corrupt { .. }
                | Error::NotFound { .. }
                | Error::Storage(object_store::Error::NotFound { .. })
        )
    }

    /// True when stored data cannot be used here: damage ([`Self::is_damage`])
    /// or [`Error::Unsupported`]. For what reads records it can only take or
    /// leave (an epoch claim, a manifest the tiered flusher copies).
    pub fn is_unusable(&self) -> bool {
        self.is_damage() || matches!(self, Error::Unsupported(_))
    }

    /// The same error again, for reporting one failure in two places (the
    /// variant and its fields are kept; storage and I/O errors keep their
    /// message and operating-system error number).
    pub fn duplicate(&self) -> Error {
        crate::error::wire::WireError::from(self).into_error("")
    }

    /// The error in the form that crosses between ranks and processes: its
    /// variant and fields as JSON (storage and I/O errors keep their message
    /// and operating-system error number). [`Error::from_wire`] reads it back.
    pub fn to_wire(&self) -> Vec<u8> {
        // A WireError is strings, integers and booleans: it always serialises.
        serde_json::to_vec(&crate::error::wire::WireError::from(self))
            .unwrap_or_else(|_| b"{\"kind\":\"internal\",\"message\":\"?\"}".to_vec())
    }

    /// An error made by [`Error::to_wire`] (on this rank or another), as the
    /// same variant, with `context` (e.g. `rank 1: `) in front of its message.
    /// Bytes that are not such a form are [`Error::InvalidInput`].
    pub fn from_wire(bytes: &[u8], context: &str) -> Result<Error> {
        let wire: crate::error::wire::WireError = serde_json::from_slice(bytes)
            .map_err(|e| Error::InvalidInput(format!("not an error in its wire form: {e}")))?;
        Ok(wire.into_error(context))
    }

    /// A storage error raised elsewhere (another process, the Python
    /// package), from its message and operating-system error number, as the
    /// wire form rebuilds one.
    pub fn remote_storage(message: impl Into<String>, errno: Option<i32>) -> Error {
        crate::error::wire::WireError::Storage {
            message: message.into(),
            errno,
            not_found: false,
        }
        .into_error("")
    }

    /// A local I/O error raised elsewhere, from its message and error number.
    pub fn remote_io(message: impl Into<String>, errno: Option<i32>) -> Error {
        crate::error::wire::WireError::Io {
            message: message.into(),
            errno,
        }
        .into_error("")
    }

    /// The operating system's error number under a storage or I/O error
    /// (`ENOSPC` for a full disk), also when the error came from another rank.
    pub fn os_errno(&self) -> Option<i32> {
        fn walk(mut e: Option<&(dyn std::error::Error + 'static)>) -> Option<i32> {
            while let Some(err) = e {
                if let Some(r) = err.downcast_ref::<crate::error::wire::Remote>() {
                    return r.errno;
                }
                if let Some(io) = err.downcast_ref::<std::io::Error>() {
                    if let Some(n) = io.raw_os_error() {
                        return Some(n);
                    }
                    if let Some(inner) = io.get_ref() {
                        if let Some(n) = walk(Some(inner)) {
                            return Some(n);
                        }
                    }
                }
                e = err.source();
            }
            None
        }
        match self {
            Error::Storage(s) => walk(Some(s)),
            Error::Io(io) => walk(Some(io)),
            _ => None,
        }
    }

    /// Attach a tensor name to a corruption error that lacks one.
    pub fn with_tensor(self, name: &str) -> Self {
        match self {
            Error::Corrupt {
                object,
                tensor: None,
                reason,
            } => Error::Corrupt {
                object,
                tensor: Some(name.to_owned()),
                reason,
            },
            other => other,
        }
    }
}
