//! Writing: libhdf5 lays the file out, the tensor bytes are spliced in.
//!
//! libhdf5 writes the file's structure (superblock, groups, attributes, dataset
//! headers) to a temporary file and reserves each tensor's bytes without
//! writing them (contiguous layout, allocated early, never filled). The file
//! stored is that structure with each tensor's own bytes in its reserved range,
//! so tensor data is never copied or written twice; h5py reading it back is what
//! checks the offsets (see the interop tests).

use std::collections::HashMap;
use std::os::unix::fs::FileExt;

use bytes::Bytes;
use ckpt_core::{DType, Value};
use hdf5::Group;

use super::dtypes::storage;
use super::error::H5Error;
use super::ffi;
use super::h5;
use super::names::{place_all, Place, FLAT_GROUP};
use super::{ATTR_DTYPE, ATTR_INDEX, ATTR_META, ATTR_NAME, ATTR_SHAPE};

/// A tensor to lay out: name, dtype, shape and byte length.
#[derive(Debug, Clone)]
pub struct Entry {
    /// Tensor name.
    pub name: String,
    /// Element type.
    pub dtype: DType,
    /// Shape.
    pub shape: Vec<u64>,
    /// Bytes.
    pub len: u64,
}

/// A file laid out by libhdf5, waiting for its tensor bytes.
#[derive(Debug)]
pub struct Laid {
    file: tempfile::NamedTempFile,
    /// Length of the whole file.
    pub file_len: u64,
    /// File offset of each tensor's bytes, in input order (0 for empty tensors).
    pub offsets: Vec<u64>,
}

/// A piece of the final file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Piece {
    /// Bytes `start..end` of the laid-out file (structure libhdf5 wrote).
    File(u64, u64),
    /// The bytes of tensor `i`.
    Tensor(usize),
}

/// Lay out a file holding `entries` and, unless `Null`, `meta` (as JSON).
pub fn lay_out(entries: &[Entry], meta: &Value) -> Result<Laid, H5Error> {
    let names: Vec<&str> = entries.iter().map(|e| e.name.as_str()).collect();
    let places = place_all(&names)?;
    let meta_json = match meta {
        Value::Null => None,
        m => Some(serde_json::to_string(m).map_err(|e| H5Error::Malformed(format!("meta: {e}")))?),
    };
    let file = tempfile::Builder::new()
        .prefix("ckpt-")
        .suffix(".h5")
        .tempfile()?;
    let offsets = ffi::locked(|| -> Result<Vec<u64>, H5Error> {
        let f = h5::create_file(file.path())?;
        let offsets = {
            let root = h5::root(&f)?;
            if let Some(json) = &meta_json {
                h5::write_str_attr(&root, ATTR_META, json)?;
            }
            let mut groups: HashMap<String, Group> = HashMap::new();
            let mut offsets = Vec::with_capacity(entries.len());
            for (i, (e, place)) in entries.iter().zip(&places).enumerate() {
                let (parent, leaf) = match place {
                    Place::Path(parts) => {
                        let (leaf, dirs) = parts.split_last().expect("names are non-empty");
                        (group(&root, &mut groups, dirs)?, leaf.as_str())
                    }
                    Place::Flat(link) => (
                        group(&root, &mut groups, &[FLAT_GROUP.to_owned()])?,
                        link.as_str(),
                    ),
                };
                let parent = parent.unwrap_or(&root);
                let (t, packed) = storage(e.dtype);
                let shape = if packed { vec![e.len] } else { e.shape.clone() };
                let tid = ffi::make_type(&t)?;
                let (d, off) = h5::create_dataset(parent, leaf, &tid, &shape, e.len)?;
                h5::write_str_attr(&d, ATTR_DTYPE, e.dtype.name())?;
                h5::write_u64_attr(&d, ATTR_INDEX, &[i as u64], false)?;
                if packed {
                    h5::write_u64_attr(&d, ATTR_SHAPE, &e.shape, true)?;
                }
                if matches!(place, Place::Flat(_)) {
                    h5::write_str_attr(&d, ATTR_NAME, &e.name)?;
                }
                offsets.push(off.unwrap_or(0));
            }
            offsets
        };
        h5::close_file(f)?;
        Ok(offsets)
    })?;
    let file_len = file.as_file().metadata()?.len();
    Ok(Laid {
        file,
        file_len,
        offsets,
    })
}

/// Open (creating as needed) the group at `dirs`; `None` for the root.
fn group<'a>(
    root: &Group,
    groups: &'a mut HashMap<String, Group>,
    dirs: &[String],
) -> Result<Option<&'a Group>, H5Error> {
    if dirs.is_empty() {
        return Ok(None);
    }
    let mut path = String::new();
    for d in dirs {
        let parent = path.clone();
        if !path.is_empty() {
            path.push('/');
        }
        path.push_str(d);
        if !groups.contains_key(&path) {
            let g = h5::create_group(groups.get(&parent).unwrap_or(root), d)?;
            groups.insert(path.clone(), g);
        }
    }
    Ok(groups.get(&path))
}

/// The pieces of a file of `file_len` bytes whose tensors occupy `(offset, len)`:
/// structure and tensor bytes in file order. Checks that the tensor ranges lie in
/// the file and do not overlap (all arithmetic checked).
pub fn splice(file_len: u64, ranges: &[(u64, u64)]) -> Result<Vec<Piece>, H5Error> {
    let mut order: Vec<usize> = (0..ranges.len()).filter(|&i| ranges[i].1 > 0).collect();
    order.sort_by_key(|&i| ranges[i].0);
    let mut pieces = Vec::with_capacity(order.len() * 2 + 1);
    let mut at = 0u64;
    for i in order {
        let (off, len) = ranges[i];
        let end = off
            .checked_add(len)
            .ok_or_else(|| H5Error::Malformed(format!("tensor {i}: range overflows")))?;
        if off < at || end > file_len {
            return Err(H5Error::Malformed(format!(
                "tensor {i}: bytes {off}..{end} overlap another tensor or pass the end ({file_len})"
            )));
        }
        if off > at {
            pieces.push(Piece::File(at, off));
        }
        pieces.push(Piece::Tensor(i));
        at = end;
    }
    if at < file_len {
        pieces.push(Piece::File(at, file_len));
    }
    Ok(pieces)
}

impl Laid {
    /// The file's bytes as parts: structure read from the temporary file, tensor
    /// bytes as given (`datas[i]` is tensor `i`, of the length laid out).
    pub fn parts(&self, datas: &[Bytes]) -> Result<Vec<Bytes>, H5Error> {
        let ranges: Vec<(u64, u64)> = self
            .offsets
            .iter()
            .zip(datas)
            .map(|(&o, d)| (o, d.len() as u64))
            .collect();
        let mut out = Vec::new();
        for p in splice(self.file_len, &ranges)? {
            match p {
                Piece::Tensor(i) => out.push(datas[i].clone()),
                Piece::File(start, end) => {
                    let len = usize::try_from(end - start)
                        .map_err(|_| H5Error::TooLarge("file structure".into()))?;
                    let mut buf = vec![0u8; len];
                    self.file.as_file().read_exact_at(&mut buf, start)?;
                    out.push(Bytes::from(buf));
                }
            }
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splice_interleaves_structure_and_tensors() {
        let got = splice(100, &[(50, 10), (10, 0), (20, 5), (90, 10)]).unwrap();
        assert_eq!(
            got,
            [
                Piece::File(0, 20),
                Piece::Tensor(2),
                Piece::File(25, 50),
                Piece::Tensor(0),
                Piece::File(60, 90),
                Piece::Tensor(3)
            ]
        );
    }

    #[test]
    fn splice_refuses_overlaps_and_overruns() {
        assert!(splice(100, &[(10, 20), (20, 5)]).is_err());
        assert!(splice(100, &[(95, 10)]).is_err());
        assert!(splice(100, &[(u64::MAX, 2)]).is_err());
    }
}
