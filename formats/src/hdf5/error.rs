//! What can go wrong reading or writing an HDF5 file.

use crate::error::CodecError;

/// An HDF5 file that ckpt cannot write or will not read.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum H5Error {
    /// libhdf5 failed (with its error stack's message).
    #[error("libhdf5: {0}")]
    Library(String),
    /// The file holds something ckpt does not import (a string dataset, a soft or
    /// external link, an enum that is not h5py's bool, ...), or a tensor cannot be
    /// written as asked.
    #[error("unsupported: {0}")]
    Unsupported(String),
    /// The file is inconsistent (two datasets map to one tensor name, a
    /// `ckpt_dtype` attribute that does not fit the stored type, ...).
    #[error("malformed: {0}")]
    Malformed(String),
    /// A size, count or depth exceeds the reader's limits.
    #[error("too large: {0}")]
    TooLarge(String),
    /// Reading or writing the local (temporary) file failed.
    #[error("i/o: {0}")]
    Io(#[from] std::io::Error),
}

impl From<H5Error> for CodecError {
    fn from(e: H5Error) -> Self {
        match e {
            H5Error::TooLarge(m) => CodecError::TooLarge(m),
            other => CodecError::Malformed(other.to_string()),
        }
    }
}

impl From<H5Error> for ckpt_core::Error {
    fn from(e: H5Error) -> Self {
        match e {
            H5Error::Unsupported(m) => ckpt_core::Error::Unsupported(format!("hdf5: {m}")),
            H5Error::Malformed(m) | H5Error::TooLarge(m) => {
                ckpt_core::Error::InvalidInput(format!("hdf5: {m}"))
            }
            H5Error::Io(e) => ckpt_core::Error::Io(e),
            H5Error::Library(m) => ckpt_core::Error::Internal(format!("libhdf5: {m}")),
        }
    }
}

impl H5Error {
    /// Turn into a ckpt corruption error about a file (for reads of damaged files).
    pub fn into_corrupt(self, object: &str) -> ckpt_core::Error {
        match self {
            H5Error::Io(e) => ckpt_core::Error::Io(e),
            other => ckpt_core::Error::corrupt(object, None, other.to_string()),
        }
    }
}
