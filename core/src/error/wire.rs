//! An [`Error`] as it crosses between ranks (and between the two places one
//! failure is reported): its variant and fields, serialisable, so that every
//! rank of a save rebuilds the same variant as the rank that failed. A full disk
//! on rank 1 is [`Error::Storage`] with `ENOSPC` on every rank, not a string.

use serde::{Deserialize, Serialize};

use crate::error::Error;

/// The serialisable form of an [`Error`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub(crate) enum WireError {
    NotFound {
        what: String,
    },
    Corrupt {
        object: String,
        tensor: Option<String>,
        reason: String,
    },
    Conflict {
        message: String,
    },
    Fenced {
        epoch: u64,
        current: u64,
    },
    InvalidInput {
        message: String,
    },
    Unsupported {
        message: String,
    },
    Storage {
        message: String,
        /// The operating system's error number under it (`ENOSPC`, `EACCES`, ...).
        errno: Option<i32>,
        /// An object that is not there (the data is missing, not the store failing).
        not_found: bool,
    },
    Io {
        message: String,
        errno: Option<i32>,
    },
    Timeout {
        message: String,
    },
    Stragglers {
        what: String,
        ranks: Vec<usize>,
        world: usize,
        timeout_ms: u64,
    },
    Skipped {
        step: u64,
        reason: String,
    },
    Internal {
        message: String,
    },
}

/// The source of a rebuilt storage or I/O error: the original message and errno.
#[derive(Debug)]
pub(crate) struct Remote {
    pub message: String,
    pub errno: Option<i32>,
}

impl std::fmt::Display for Remote {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for Remote {}

impl From<&Error> for WireError {
    fn from(e: &Error) -> Self {
        match e {
            Error::NotFound { what } => WireError::NotFound { what: what.clone() },
            Error::Corrupt {
                object,
                tensor,
                reason,
            } => WireError::Corrupt {
                object: object.clone(),
                tensor: tensor.clone(),
                reason: reason.clone(),
            },
            Error::Conflict(m) => WireError::Conflict { message: m.clone() },
            Error::Fenced { epoch, current } => WireError::Fenced {
                epoch: *epoch,
                current: *current,
            },
            Error::InvalidInput(m) => WireError::InvalidInput { message: m.clone() },
            Error::Unsupported(m) => WireError::Unsupported { message: m.clone() },
            Error::Storage(s) => WireError::Storage {
                message: match s {
                    // The message of a rebuilt error is the original one, not wrapped again.
                    object_store::Error::Generic { source, .. } if source.is::<Remote>() => {
                        source.to_string()
                    }
                    object_store::Error::NotFound { source, .. } if source.is::<Remote>() => {
                        source.to_string()
                    }
                    s => s.to_string(),
                },
                errno: e.os_errno(),
                not_found: matches!(s, object_store::Error::NotFound { .. }),
            },
            Error::Io(io) => WireError::Io {
                message: match io.get_ref() {
                    Some(r) if r.is::<Remote>() => r.to_string(),
                    _ => io.to_string(),
                },
                errno: e.os_errno(),
            },
            Error::Timeout(m) => WireError::Timeout { message: m.clone() },
            Error::Stragglers {
                what,
                ranks,
                world,
                timeout_ms,
            } => WireError::Stragglers {
                what: what.clone(),
                ranks: ranks.clone(),
                world: *world,
                timeout_ms: *timeout_ms,
            },
            Error::Skipped { step, reason } => WireError::Skipped {
                step: *step,
                reason: reason.clone(),
            },
            Error::Internal(m) => WireError::Internal { message: m.clone() },
        }
    }
}

impl WireError {
    /// The error again, the same variant; `context` (e.g. `rank 1: `) goes in
    /// front of its message.
    pub(crate) fn into_error(self, context: &str) -> Error {
        let c = |m: String| format!("{context}{m}");
        match self {
            WireError::NotFound { what } => Error::NotFound { what: c(what) },
            WireError::Corrupt {
                object,
                tensor,
                reason,
            } => Error::Corrupt {
                object,
                tensor,
                reason: c(reason),
            },
            WireError::Conflict { message } => Error::Conflict(c(message)),
            WireError::Fenced { epoch, current } => Error::Fenced { epoch, current },
            WireError::InvalidInput { message } => Error::InvalidInput(c(message)),
            WireError::Unsupported { message } => Error::Unsupported(c(message)),
            WireError::Storage {
                message,
                errno,
                not_found,
            } => {
                let source = Box::new(Remote {
                    message: c(message.clone()),
                    errno,
                });
                Error::Storage(if not_found {
                    object_store::Error::NotFound {
                        path: message,
                        source,
                    }
                } else {
                    object_store::Error::Generic {
                        store: "ckpt",
                        source,
                    }
                })
            }
            WireError::Io { message, errno } => {
                let kind = errno.map_or(std::io::ErrorKind::Other, |n| {
                    std::io::Error::from_raw_os_error(n).kind()
                });
                Error::Io(std::io::Error::new(
                    kind,
                    Remote {
                        message: c(message),
                        errno,
                    },
                ))
            }
            WireError::Timeout { message } => Error::Timeout(c(message)),
            WireError::Stragglers {
                what,
                ranks,
                world,
                timeout_ms,
            } => Error::Stragglers {
                what: c(what),
                ranks,
                world,
                timeout_ms,
            },
            WireError::Skipped { step, reason } => Error::Skipped {
                step,
                reason: c(reason),
            },
            WireError::Internal { message } => Error::Internal(c(message)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn across(e: &Error) -> Error {
        let json = serde_json::to_vec(&WireError::from(e)).unwrap();
        serde_json::from_slice::<WireError>(&json)
            .unwrap()
            .into_error("rank 1: ")
    }

    #[test]
    fn a_full_disk_stays_a_storage_error_with_its_errno() {
        let e = Error::Storage(object_store::Error::Generic {
            store: "LocalFileSystem",
            source: Box::new(std::io::Error::from_raw_os_error(28)),
        });
        assert_eq!(e.os_errno(), Some(28));
        let back = across(&e);
        assert!(matches!(back, Error::Storage(_)), "{back:?}");
        assert_eq!(back.os_errno(), Some(28));
        assert!(back.to_string().contains("rank 1: "), "{back}");
        // Twice across keeps it too, without nesting the message.
        let twice = across(&back);
        assert_eq!(twice.os_errno(), Some(28));
        assert_eq!(twice.to_string().matches("storage error").count(), 1);
    }

    #[test]
    fn every_variant_comes_back_as_itself() {
        let io = Error::Io(std::io::Error::from_raw_os_error(13));
        let cases = [
            Error::NotFound { what: "x".into() },
            Error::corrupt("chunks/ab", Some("w"), "hash mismatch"),
            Error::Conflict("c".into()),
            Error::InvalidInput("i".into()),
            Error::Unsupported("u".into()),
            Error::Storage(object_store::Error::NotFound {
                path: "p".into(),
                source: "gone".into(),
            }),
            io,
            Error::Timeout("t".into()),
            Error::Stragglers {
                what: "gather".into(),
                ranks: vec![3, 17],
                world: 64,
                timeout_ms: 1000,
            },
            Error::Skipped {
                step: 4,
                reason: "busy".into(),
            },
            Error::Internal("?".into()),
            Error::Fenced {
                epoch: 3,
                current: 4,
            },
        ];
        for e in &cases {
            let back = across(e);
            assert_eq!(
                std::mem::discriminant(e),
                std::mem::discriminant(&back),
                "{e:?} -> {back:?}"
            );
            assert_eq!(e.is_damage(), back.is_damage(), "{e:?}");
            assert_eq!(e.os_errno(), back.os_errno(), "{e:?}");
        }
        match across(&cases[1]) {
            Error::Corrupt { object, tensor, .. } => {
                assert_eq!(
                    (object.as_str(), tensor.as_deref()),
                    ("chunks/ab", Some("w"))
                )
            }
            other => panic!("{other:?}"),
        }
        match across(&cases[8]) {
            Error::Stragglers { ranks, world, .. } => assert_eq!((ranks, world), (vec![3, 17], 64)),
            other => panic!("{other:?}"),
        }
        match across(&cases[9]) {
            Error::Skipped { step, .. } => assert_eq!(step, 4),
            other => panic!("{other:?}"),
        }
    }
}
