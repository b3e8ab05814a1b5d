//! What retention and a restart ask of the store as checkpoints accumulate:
//! one rank keeping `K` checkpoints, its `K + 1`-th commit's GC (which
//! retires one), and a fresh checkpointer opening the root (build, then the
//! listing a restart resumes from).

use std::sync::Arc;

use ckpt_core::store::Capabilities;
use serde::Serialize;

use super::sim::{fresh_root, options, save, Job};
use super::state::Shape;
use super::store::{RankStore, Requests};
use crate::experiments::Error;

/// The figures at `stored` checkpoints.
#[derive(Debug, Clone, Serialize)]
pub struct StoredFigures {
    /// Checkpoints on the root.
    pub stored: usize,
    /// Requests of the last commit after its manifest (fence check, retention, GC).
    pub gc: Option<Requests>,
    /// Requests of opening a checkpointer and listing the committed checkpoints.
    pub open: Requests,
}

/// Keep `stored` checkpoints of one rank's `shape` and measure.
pub async fn measure(stored: usize, shape: Shape) -> Result<StoredFigures, Error> {
    let stored = stored.max(1);
    let (url, inner) = fresh_root("stored");
    let job = Job::open(&inner, &url, 1, options(stored, false)).await?;
    let mut gc = None;
    for k in 1..=stored + 1 {
        gc = save(&job, shape, k, k as u64).await?.0.after_manifest;
    }
    drop(job);
    let store = Arc::new(RankStore::new(inner));
    let cp = ckpt_formats::builder(url.as_str())
        .store(store.clone())
        .capabilities(Capabilities::of_url(&url))
        .options(options(stored, false))
        .build()
        .await?;
    let listed = cp.committed().await?;
    if listed.len() != stored {
        return Err(format!("{} checkpoints listed, {stored} kept", listed.len()).into());
    }
    Ok(StoredFigures {
        stored,
        gc,
        open: store.counts().all(),
    })
}
