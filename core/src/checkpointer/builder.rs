//! [`CheckpointerBuilder`]: how a [`Checkpointer`] is opened.

use std::sync::{Arc, Mutex};

use object_store::ObjectStore;

use super::{
    Checkpointer, CheckpointerOptions, Fencing, InFlight, Known, Shared, SnapshotMode, Turns,
};
use crate::coord::{Coordinator, RollCall, Solo};
use crate::error::{Error, Result};
use crate::format::{Compression, Format, FormatRegistry};
use crate::layout::chunks::ChunkIndex;
use crate::layout::retention::Retention;
use crate::staging::{BusyPolicy, StagingPool};
use crate::store::{self, Capabilities};

/// Builds a [`Checkpointer`].
#[derive(Debug)]
pub struct CheckpointerBuilder {
    url: String,
    store: Option<Arc<dyn ObjectStore>>,
    caps: Option<Capabilities>,
    format: Option<Arc<dyn Format>>,
    registry: FormatRegistry,
    opts: CheckpointerOptions,
    coord: Arc<dyn Coordinator>,
}

impl Checkpointer {
    /// Start building a checkpointer for a URL (`file:///dir`, `memory://name`, a path).
    pub fn builder(url: impl Into<String>) -> CheckpointerBuilder {
        CheckpointerBuilder {
            url: url.into(),
            store: None,
            caps: None,
            format: None,
            registry: FormatRegistry::new(),
            opts: CheckpointerOptions::default(),
            coord: Arc::new(Solo),
        }
    }
}

impl CheckpointerBuilder {
    /// Format for new checkpoints (required). It is also registered for loading.
    pub fn format(mut self, format: Arc<dyn Format>) -> Self {
        self.registry.register(format.clone());
        self.format = Some(format);
        self
    }

    /// Formats that loads can read (in addition to the write format).
    pub fn readers(mut self, registry: FormatRegistry) -> Self {
        let write = self.format.clone();
        self.registry = registry;
        if let Some(f) = write {
            self.registry.register(f);
        }
        self
    }

    /// Use this store instead of opening the URL (wrappers, tests, custom backends).
    pub fn store(mut self, store: Arc<dyn ObjectStore>) -> Self {
        self.store = Some(store);
        self
    }

    /// What the store is good at. Default: what [`Capabilities::of_url`] says
    /// of the URL when the builder opens it, [`Capabilities::conservative`]
    /// for a store given with [`Self::store`].
    pub fn capabilities(mut self, caps: Capabilities) -> Self {
        self.caps = Some(caps);
        self
    }

    /// Replace all options.
    pub fn options(mut self, opts: CheckpointerOptions) -> Self {
        self.opts = opts;
        self
    }

    /// Set the retention policy.
    pub fn retention(mut self, retention: Retention) -> Self {
        self.opts.retention = retention;
        self
    }

    /// Set compression.
    pub fn compression(mut self, compression: Compression) -> Self {
        self.opts.write.compression = compression;
        self
    }

    /// Set the snapshot mode.
    pub fn snapshot(mut self, mode: SnapshotMode) -> Self {
        self.opts.snapshot = mode;
        self
    }

    /// Set the staging budget in bytes.
    pub fn staging_budget(mut self, bytes: u64) -> Self {
        self.opts.staging_budget = Some(bytes);
        self
    }

    /// Open the root for reading only ([`CheckpointerOptions::read_only`]).
    pub fn read_only(mut self) -> Self {
        self.opts.read_only = true;
        self
    }

    /// Set the busy policy.
    pub fn busy(mut self, policy: BusyPolicy) -> Self {
        self.opts.busy = policy;
        self
    }

    /// Coordinate with the other ranks of a job (default: a job of one process).
    ///
    /// Every rank builds its checkpointer on the same URL and calls `save` for the
    /// same steps in the same order; each writes its share, and rank 0 commits once
    /// every share is durable.
    pub fn coordinator(mut self, coord: Arc<dyn Coordinator>) -> Self {
        self.coord = coord;
        self
    }

    /// Open the store (nothing is listed: the first save learns the chunks
    /// it can reuse from the newest committed checkpoint).
    pub async fn build(self) -> Result<Checkpointer> {
        let format = self.format.ok_or_else(|| {
            Error::InvalidInput("no format chosen (use ckpt_formats::native())".into())
        })?;
        if self.opts.write.chunk_size == 0 || self.opts.write.chunk_size > crate::MAX_CHUNK_BYTES {
            return Err(Error::InvalidInput(format!(
                "chunk size must be between 1 and {} bytes",
                crate::MAX_CHUNK_BYTES
            )));
        }
        if let Compression::Zstd(level) = self.opts.write.compression {
            if !(1..=22).contains(&level) {
                return Err(Error::InvalidInput(format!(
                    "zstd level {level} is not in 1..=22"
                )));
            }
        }
        let (store, default_caps) = match self.store {
            Some(s) => (s, Capabilities::conservative()),
            None => (store::open_url(&self.url)?, Capabilities::of_url(&self.url)),
        };
        let caps = self.caps.unwrap_or(default_caps);
        if self.coord.world_size() > 1 && self.opts.busy == BusyPolicy::Skip {
            return Err(Error::InvalidInput(
                "BusyPolicy::Skip is not available in a job of several ranks: a skip on one rank \
                 would leave the others waiting; use BusyPolicy::Wait"
                    .into(),
            ));
        }
        // Seeded by the first save, not listed (layout/chunks.rs).
        let chunks = Arc::new(ChunkIndex::new());
        let pool = self.opts.staging_budget.map(StagingPool::new);
        // Every rank derives the same attempt ids from a value rank 0 chooses.
        let nonce = {
            let mine = crate::layout::paths::new_attempt_id().into_bytes();
            let agreed = self
                .coord
                .broadcast(mine, 0, self.opts.collective_timeout)
                .await?;
            String::from_utf8(agreed).map_err(|_| Error::Internal("bad job nonce".into()))?
        };
        // From here on a collective that times out names who was missing. A
        // read-only checkpointer too: its only writes are these marks, made
        // only in a long wait; where the store refuses them (a read-only
        // bucket) the timeout stays unnamed.
        let coord: Arc<dyn Coordinator> = if self.coord.world_size() > 1 {
            Arc::new(RollCall::new(self.coord, store.clone(), &nonce))
        } else {
            self.coord
        };
        let claims = !self.opts.read_only && self.opts.fencing && coord.rank() == 0;
        let fencing = Fencing::new(
            claims,
            nonce.clone(),
            caps.claim_strength(),
            self.opts.fence_lease,
        );
        Ok(Checkpointer {
            inner: Arc::new(Shared {
                url: self.url,
                store,
                caps,
                format,
                registry: self.registry,
                opts: self.opts,
                chunks,
                coord,
                pool: Mutex::new(pool),
                in_flight: InFlight::default(),
                known: Known::default(),
                turns: Turns::new(nonce),
                fencing,
                plan_memo: Default::default(),
                gc_refs: Default::default(),
                gc_rounds: Default::default(),
            }),
        })
    }
}
