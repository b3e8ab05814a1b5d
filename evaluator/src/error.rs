//! The evaluator's error: what an experiment, the suite or the report can fail with.

/// An error of `ckpt-eval`.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// ckpt itself failed (a save, a load, a store).
    #[error(transparent)]
    Ckpt(#[from] ckpt_core::Error),
    /// A file, a directory or a child process.
    #[error(transparent)]
    Io(#[from] std::io::Error),
    /// A script's or a file's JSON.
    #[error(transparent)]
    Json(#[from] serde_json::Error),
    /// An object store (the S3 experiment's baseline).
    #[error(transparent)]
    Store(#[from] object_store::Error),
    /// A task of the experiment panicked or was cancelled.
    #[error(transparent)]
    Task(#[from] tokio::task::JoinError),
    /// Anything else, said in words: a measurement that is wrong, a script
    /// that failed (with its output's tail), a missing prerequisite.
    #[error("{0}")]
    Failed(String),
}

impl From<String> for Error {
    fn from(s: String) -> Error {
        Error::Failed(s)
    }
}

impl From<&str> for Error {
    fn from(s: &str) -> Error {
        Error::Failed(s.to_owned())
    }
}

/// The evaluator's result.
pub type Result<T, E = Error> = std::result::Result<T, E>;
