//! Where each tensor goes in the file: the entry of the state (the name up to its
//! first dot) becomes a group, the rest (the state-dict key) the dataset, with an
//! escape hatch for names that cannot be paths. Pure (no libhdf5).
//!
//! `model.layers.0.weight` is the dataset `layers.0.weight` of the group
//! `/model`, so h5py users browse `f["model"]` as they would the state dict. A
//! name is placed this way when both parts are non-empty, have no `/` and are
//! not `.`, and no other tensor is named like the entry (`a` next to `a.b` would
//! have to be a dataset and a group at once); a name without a dot is a dataset
//! of the root. Every other name is a dataset of the root group
//! [`FLAT_GROUP`], named by the tensor name with `%` written `%25` and `/` written
//! `%2F` (and a lone `.` as `%2E`), and carries its exact name in the attribute
//! `ckpt_name`. [`FLAT_GROUP`] has a dot in its name, so no dotted path can
//! collide with it.

use std::collections::HashSet;

use super::error::H5Error;

/// Root group of the tensors whose names are not paths.
pub const FLAT_GROUP: &str = "ckpt.flat";

/// Where one tensor is stored.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Place {
    /// At the path of its dot-separated parts (groups, then the dataset).
    Path(Vec<String>),
    /// In [`FLAT_GROUP`] under this (escaped) link name, with a `ckpt_name` attribute.
    Flat(String),
}

impl Place {
    /// The dataset's path from the root, `/`-separated.
    pub fn path(&self) -> String {
        match self {
            Place::Path(parts) => parts.join("/"),
            Place::Flat(link) => format!("{FLAT_GROUP}/{link}"),
        }
    }
}

fn link_ok(part: &str) -> bool {
    !part.is_empty() && part != "." && !part.contains('/')
}

/// The group and dataset of a name placed as a path (`None`: no group).
fn split(name: &str) -> Option<(Option<&str>, &str)> {
    match name.split_once('.') {
        Some((entry, key)) => (link_ok(entry) && link_ok(key)).then_some((Some(entry), key)),
        None => link_ok(name).then_some((None, name)),
    }
}

/// The link name of a tensor in [`FLAT_GROUP`] (injective on names).
pub fn escape(name: &str) -> String {
    if name == "." {
        return "%2E".to_owned();
    }
    let mut out = String::with_capacity(name.len());
    for c in name.chars() {
        match c {
            '%' => out.push_str("%25"),
            '/' => out.push_str("%2F"),
            c => out.push(c),
        }
    }
    out
}

/// Place every tensor. Names must be unique, non-empty and free of NUL bytes
/// (HDF5 names are C strings).
pub fn place_all(names: &[&str]) -> Result<Vec<Place>, H5Error> {
    let mut seen = HashSet::with_capacity(names.len());
    let mut prefixes = HashSet::new();
    for &n in names {
        if n.is_empty() || n.contains('\0') {
            return Err(H5Error::Unsupported(format!(
                "tensor name {n:?} is empty or holds a NUL byte"
            )));
        }
        if !seen.insert(n) {
            return Err(H5Error::Malformed(format!("tensor name `{n}` is repeated")));
        }
        if let Some((Some(entry), _)) = split(n) {
            prefixes.insert(entry);
        }
    }
    Ok(names
        .iter()
        .map(|&n| match split(n) {
            Some((Some(entry), key)) => Place::Path(vec![entry.to_owned(), key.to_owned()]),
            Some((None, leaf)) if !prefixes.contains(leaf) => Place::Path(vec![leaf.to_owned()]),
            _ => Place::Flat(escape(n)),
        })
        .collect())
}

/// The tensor name of a dataset found at `parts` (its path from the root), when
/// it has no `ckpt_name` attribute.
pub fn name_of(parts: &[String]) -> String {
    parts.join(".")
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn dotted_names_become_paths_and_conflicts_go_flat() {
        let names = [
            "model.layers.0.weight",
            "a.b",
            "a.b.c",
            "x/y",
            "p..q",
            ".",
            "%",
            "top",
        ];
        // A name without a dot that is also an entry goes flat.
        let both = place_all(&["a", "a.b"]).unwrap();
        assert_eq!(both[0].path(), "ckpt.flat/a");
        assert_eq!(both[1].path(), "a/b");
        let got: Vec<String> = place_all(&names).unwrap().iter().map(Place::path).collect();
        assert_eq!(
            got,
            [
                "model/layers.0.weight",
                "a/b",
                "a/b.c",
                "ckpt.flat/x%2Fy",
                "p/.q",
                "ckpt.flat/%2E",
                "%",
                "top"
            ]
        );
    }

    #[test]
    fn repeated_empty_and_nul_names_are_refused() {
        assert!(matches!(place_all(&["a", "a"]), Err(H5Error::Malformed(_))));
        assert!(matches!(place_all(&[""]), Err(H5Error::Unsupported(_))));
        assert!(matches!(place_all(&["a\0b"]), Err(H5Error::Unsupported(_))));
    }

    proptest! {
        /// Every placement is a distinct dataset path, and no dataset path is a
        /// group of another one.
        #[test]
        fn paths_are_distinct_and_never_groups(names in proptest::collection::hash_set("[ab./%]{1,6}", 0..12)) {
            let names: Vec<&str> = names.iter().map(String::as_str).collect();
            let places = place_all(&names).unwrap();
            let paths: Vec<String> = places.iter().map(Place::path).collect();
            let set: HashSet<&str> = paths.iter().map(String::as_str).collect();
            prop_assert_eq!(set.len(), paths.len());
            for p in &paths {
                for q in &paths {
                    prop_assert!(!q.starts_with(&format!("{p}/")), "{} under {}", q, p);
                }
                prop_assert!(p.split('/').all(|c| !c.is_empty() && c != "."));
            }
            for (n, pl) in names.iter().zip(&places) {
                if let Place::Path(parts) = pl {
                    prop_assert_eq!(&name_of(parts), n);
                }
            }
        }
    }
}
