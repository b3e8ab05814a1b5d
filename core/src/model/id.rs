//! The identity of one checkpoint.

use std::fmt;

/// Identifies one checkpoint: the training step and the attempt that wrote it.
///
/// Two saves of the same step never share objects: each gets its own attempt id,
/// so a second writer can never overwrite what a first one committed.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct CheckpointId {
    /// The training step the checkpoint was taken at.
    pub step: u64,
    /// A short random id of the save attempt (hex).
    pub attempt: String,
}

impl fmt::Display for CheckpointId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "step {} (attempt {})", self.step, self.attempt)
    }
}
