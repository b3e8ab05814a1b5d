//! What a campaign can fail with (a failure it injected is not an error: it
//! is what the campaign checks).

/// An error of the fault campaigns.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A file, a directory, a mount or a child process.
    #[error(transparent)]
    Io(#[from] std::io::Error),
    /// Anything else, said in words: a victim's report that cannot be read,
    /// a tmpfs that cannot be mounted, a baseline with too few restores.
    #[error("{0}")]
    Failed(String),
}

impl From<&str> for Error {
    fn from(s: &str) -> Error {
        Error::Failed(s.to_owned())
    }
}

impl From<String> for Error {
    fn from(s: String) -> Error {
        Error::Failed(s)
    }
}
