//! What a checkpoint root holds and how it is read: the key layout, the
//! manifest (the commit record), the catalog of what is stored, the index of
//! stored chunks, and retention with GC.
//!
//! ```text
//! chunks/<blake3 hex>                        content-addressed chunks, shared by all checkpoints
//! data/<step:020>-<attempt>/...              per-checkpoint objects (non-chunked formats, rank files)
//! data/<step:020>-<attempt>/records/<rank:06>.frag   a rank's records (jobs of several ranks)
//! manifests/<step:020>-<attempt>.manifest    the commit record: a checkpoint exists iff this does
//! epochs/<epoch:020>.claim                   writer epochs: which incarnation may commit and collect
//! ```
//!
//! Public for the formats and for tools that read a root directly (the CLI, the
//! evaluator's fault oracle): the key functions, listing what is committed, and
//! reading a manifest with its size cap. [`LocalRoot`] is a root on a local
//! directory as the Python package's memory tier handles it (pins, replicas).

pub(crate) mod catalog;
pub(crate) mod chunks;
pub mod epoch;
pub mod fragment;
pub mod index;
pub mod local_root;
pub(crate) mod manifest;
pub mod merge;
pub(crate) mod paths;
pub mod pymeta;
pub(crate) mod retention;

pub use catalog::{committed, incomplete, read_manifest, uncommitted};
pub use chunks::{ChunkCache, ChunkIndex};
pub use fragment::{Fragment, FragmentRef};
pub use index::IndexEntry;
pub use local_root::LocalRoot;
pub use manifest::{
    ChunkRef, Layout, Manifest, TensorRecord, MANIFEST_VERSION, MANIFEST_VERSION_FRAGMENTS,
    MANIFEST_VERSION_INLINE, MAX_MANIFEST_BYTES,
};
pub use paths::{
    checkpoint_name, chunk_key, data_prefix, manifest_key, parse_checkpoint_name, CHUNKS, DATA,
    MANIFESTS,
};
pub use retention::{GcReport, Retention, Sweep};
