//! Errors of the pure codecs in this crate.

/// What a codec found wrong with bytes it was asked to decode.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum CodecError {
    /// The bytes end before the structure they claim to hold.
    #[error("truncated: {0}")]
    Truncated(String),
    /// The bytes are not what the format expects.
    #[error("malformed: {0}")]
    Malformed(String),
    /// A size field exceeds the decoder's cap.
    #[error("too large: {0}")]
    TooLarge(String),
    /// The content does not match its hash.
    #[error("hash mismatch")]
    HashMismatch,
}

impl CodecError {
    /// Turn into a ckpt corruption error about an object and tensor.
    pub fn into_corrupt(self, object: &str, tensor: Option<&str>) -> ckpt_core::Error {
        ckpt_core::Error::corrupt(object, tensor, self.to_string())
    }
}
