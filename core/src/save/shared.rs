//! One snapshot saved by two checkpointers (the memory tier's durable steps:
//! the same state to host memory and to durable storage, copied once).
//!
//! [`Checkpointer::save_shared`](crate::Checkpointer::save_shared) hands back
//! a [`SharedSnapshot`]: in eager mode the snapshot's tensors, taken before it
//! returns; in lazy mode a [`LaterSnapshot`], which the background copy fills.
//! Another checkpointer saves it with `save` (the tensors, as
//! [`TensorData::Shared`](crate::TensorData::Shared)) or with
//! [`Checkpointer::save_snapshot`](crate::Checkpointer::save_snapshot) (a later
//! one): its bytes are the first save's staging copies, so nothing is copied
//! twice, and the training loop waits for one copy, not two.

use std::sync::Arc;

use tokio::sync::watch;

use crate::error::{Error, Result};
use crate::model::tensor::Tensor;

/// What a save shares with another checkpointer's save of the same state.
#[derive(Debug, Clone)]
pub enum SharedSnapshot {
    /// An eager save's snapshot, taken.
    Taken(Vec<Tensor>),
    /// A lazy save's snapshot, taken in the background.
    Later(LaterSnapshot),
}

/// What the snapshot task sends once: the tensors, or why there are none.
type Outcome = Option<std::result::Result<Vec<Tensor>, Arc<Error>>>;

/// A lazy save's snapshot once its background copy is done. Holding it keeps
/// the snapshot's staging memory in use after the copy; [`wait`](Self::wait)
/// consumes it.
#[derive(Debug, Clone)]
pub struct LaterSnapshot {
    rx: watch::Receiver<Outcome>,
}

/// The snapshot task's end of a [`LaterSnapshot`].
#[derive(Debug)]
pub(crate) struct LaterSender(watch::Sender<Outcome>);

/// A [`LaterSnapshot`] and the sender that fills it.
pub(crate) fn later() -> (LaterSender, LaterSnapshot) {
    let (tx, rx) = watch::channel(None);
    (LaterSender(tx), LaterSnapshot { rx })
}

impl LaterSender {
    /// Hand the snapshot's outcome to every [`LaterSnapshot`] (tensors are
    /// cloned, their bytes shared).
    pub(crate) fn send(self, outcome: &Result<Vec<Tensor>>) {
        let value = match outcome {
            Ok(ts) => Ok(ts.clone()),
            Err(e) => Err(Arc::new(e.duplicate())),
        };
        // No receiver left: nobody waits for it.
        let _ = self.0.send(Some(value));
    }
}

impl LaterSnapshot {
    /// True once the snapshot is taken (or failed).
    pub fn is_ready(&self) -> bool {
        self.rx.borrow().is_some()
    }

    /// The snapshot's tensors once it is taken; its error if it failed, and
    /// [`Error::Internal`] if its save vanished without an outcome.
    pub async fn wait(mut self) -> Result<Vec<Tensor>> {
        let outcome = self
            .rx
            .wait_for(Option::is_some)
            .await
            .map_err(|_| Error::Internal("the save sharing its snapshot vanished".into()))?
            .clone();
        match outcome {
            Some(Ok(ts)) => Ok(ts),
            Some(Err(e)) => Err(e.duplicate()),
            None => Err(Error::Internal(
                "a shared snapshot without an outcome".into(),
            )),
        }
    }
}
