//! Reading only the fragments a load needs.
//!
//! A root of a job of several ranks keeps each rank's records in a fragment
//! of its own. A load of boxes reads the root, asks its index which ranks'
//! fragments hold pieces overlapping each box ([`IndexEntry::ranks_for`]),
//! and reads those alone: a same-shape restart reads its own fragment and
//! those of the owners of the replicated tensors it takes; a reshard reads
//! the fragments that overlap its boxes.
//!
//! [`IndexEntry::ranks_for`]: crate::layout::index::IndexEntry::ranks_for

use std::collections::{BTreeSet, HashMap};

use crate::checkpointer::Checkpointer;
use crate::error::{Error, Result};
use crate::layout::index::IndexEntry;
use crate::layout::manifest::Manifest;
use crate::layout::{catalog, paths};

/// A tensor a load wants: its name and, for a box of it, offsets and extent
/// (`None`: all of it).
pub(crate) type Want<'a> = (&'a str, Option<(&'a [u64], &'a [u64])>);

impl Checkpointer {
    /// `root` with the records of the fragments that hold what `wants` asks
    /// for (a manifest that holds its records: as it is). A name the index
    /// does not list is left for the caller to report.
    pub(crate) async fn select<'a>(
        &self,
        root: Manifest,
        wants: impl IntoIterator<Item = Want<'a>>,
    ) -> Result<Manifest> {
        if !root.has_fragments() {
            return Ok(root);
        }
        let index: HashMap<&str, _> = root.index.iter().map(|e| (e.name.as_str(), e)).collect();
        let mut ranks = BTreeSet::new();
        let mut listed = BTreeSet::new();
        for (name, boxed) in wants {
            let Some((e, own)) = IndexEntry::find(&index, name) else {
                continue;
            };
            listed.insert(name.to_owned());
            if let Some(r) = own {
                ranks.insert(r);
                continue;
            }
            let zeros;
            let (offsets, shape) = match boxed {
                Some(b) => b,
                None => {
                    zeros = vec![0; e.shape.len()];
                    (&zeros[..], &e.shape[..])
                }
            };
            ranks.extend(e.ranks_for(offsets, shape));
        }
        drop(index);
        let m = catalog::expand(self.store().as_ref(), root, Some(&ranks)).await?;
        // The index said these fragments hold them: one that does not is damage.
        for t in &m.tensors {
            listed.remove(&t.name);
        }
        if let Some(name) = listed.first() {
            return Err(Error::corrupt(
                paths::manifest_key(&m.id()).as_ref(),
                Some(name),
                "the fragments the root's index names do not hold this tensor",
            ));
        }
        Ok(m)
    }
}
