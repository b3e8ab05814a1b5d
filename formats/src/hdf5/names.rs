//! Where each tensor goes in the file: dotted names become groups, with an escape
//! hatch for names that cannot be paths. Pure (no libhdf5).
//!
//! `model.layers.0.weight` is the dataset `/model/layers/0/weight`. A name is
//! placed this way when every dot-separated part is non-empty and has no `/`, and
//! no other tensor's name continues it (`a.b` next to `a.b.c` would have to be a
//! dataset and a group at once). Every other name is a dataset of the root group
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

fn well_formed(name: &str) -> bool {
    name.split('.').all(|p| !p.is_empty() && !p.contains('/'))
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
        if well_formed(n) {
            let mut end = 0;
            for part in n.split('.') {
                end += part.len();
                if end < n.len() {
                    prefixes.insert(&n[..end]);
                }
                end += 1;
            }
        }
    }
    Ok(names
        .iter()
        .map(|&n| {
            if well_formed(n) && !prefixes.contains(n) {
                Place::Path(n.split('.').map(str::to_owned).collect())
            } else {
                Place::Flat(escape(n))
            }
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
        let got: Vec<String> = place_all(&names).unwrap().iter().map(Place::path).collect();
        assert_eq!(
            got,
            [
                "model/layers/0/weight",
                "ckpt.flat/a.b",
                "a/b/c",
                "ckpt.flat/x%2Fy",
                "ckpt.flat/p..q",
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
