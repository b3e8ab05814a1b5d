//! Importing HDF5 files, written by ckpt or anything else (h5py, say).
//!
//! Every dataset becomes a tensor named by its path with `/` turned into `.`
//! (or by its `ckpt_name` attribute). Its dtype is what its HDF5 type holds
//! natively (see [`super::dtypes`]), or its `ckpt_dtype` attribute when that
//! names a dtype stored as such. Datasets carrying `ckpt_index` come first, in
//! that order; the others follow in path order. The root's `ckpt_meta`
//! attribute, when present, is the non-tensor state. Anything else is refused:
//! datasets of other types (strings, references, ...), soft and external links
//! (they would reach into other files), named datatypes. Every count, size and
//! depth is capped by [`Limits`], all before the allocation it bounds.

use ckpt_core::{DType, State, Tensor, Value};

use super::dtypes::{classify, resolve, storage, TypeDesc, BFLOAT};
use super::error::H5Error;
use super::ffi;
use super::h5::{self, LinkKind};
use super::names::name_of;
use super::{ATTR_DTYPE, ATTR_INDEX, ATTR_META, ATTR_NAME, ATTR_SHAPE};

/// Caps on what [`super::read_h5`] accepts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Largest file, and largest sum of tensor bytes.
    pub max_bytes: u64,
    /// Most datasets, and most links in one group.
    pub max_tensors: usize,
    /// Deepest group nesting.
    pub max_depth: usize,
    /// Longest string attribute (the `ckpt_meta` JSON).
    pub max_attr_bytes: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_bytes: 1 << 40,
            max_tensors: 1 << 20,
            max_depth: 64,
            max_attr_bytes: 256 << 20,
        }
    }
}

/// A file to read: on disk, or its bytes.
#[derive(Debug, Clone, Copy)]
pub enum Source<'a> {
    /// A path on the local file system.
    Path(&'a std::path::Path),
    /// The whole file in memory.
    Bytes(&'a [u8]),
}

impl<'a> From<&'a std::path::Path> for Source<'a> {
    fn from(p: &'a std::path::Path) -> Self {
        Source::Path(p)
    }
}

impl<'a> From<&'a std::path::PathBuf> for Source<'a> {
    fn from(p: &'a std::path::PathBuf) -> Self {
        Source::Path(p)
    }
}

impl<'a> From<&'a [u8]> for Source<'a> {
    fn from(b: &'a [u8]) -> Self {
        Source::Bytes(b)
    }
}

impl<'a> From<&'a Vec<u8>> for Source<'a> {
    fn from(b: &'a Vec<u8>) -> Self {
        Source::Bytes(b)
    }
}

impl<'a> From<&'a bytes::Bytes> for Source<'a> {
    fn from(b: &'a bytes::Bytes) -> Self {
        Source::Bytes(b)
    }
}

/// A dataset found while walking the file, not yet read.
#[derive(Debug)]
struct Found {
    name: String,
    index: Option<u64>,
    ds: hdf5::Dataset,
}

/// Read a whole file into a state, within `limits`.
pub fn read_with(src: Source<'_>, limits: &Limits) -> Result<State, H5Error> {
    let size = match src {
        Source::Path(p) => std::fs::metadata(p)?.len(),
        Source::Bytes(b) => b.len() as u64,
    };
    if size > limits.max_bytes {
        return Err(H5Error::TooLarge(format!("a file of {size} bytes")));
    }
    ffi::locked(|| {
        let f = match src {
            Source::Path(p) => h5::open_file(p)?,
            Source::Bytes(b) => ffi::open_image(b)?,
        };
        let state = {
            let root = h5::root(&f)?;
            let meta = match h5::read_str_attr(&root, ATTR_META, limits.max_attr_bytes)? {
                Some(json) => serde_json::from_str::<Value>(&json)
                    .map_err(|e| H5Error::Malformed(format!("{ATTR_META}: {e}")))?,
                None => Value::Null,
            };
            let mut found = Vec::new();
            walk(&root, &mut Vec::new(), &mut found, limits)?;
            // Stable: datasets without an index keep their path order, after the others.
            found.sort_by_key(|d| d.index.unwrap_or(u64::MAX));
            let mut seen = std::collections::HashSet::with_capacity(found.len());
            let mut total = 0u64;
            let mut tensors = Vec::with_capacity(found.len());
            for d in found {
                if !seen.insert(d.name.clone()) {
                    return Err(H5Error::Malformed(format!(
                        "two datasets are named `{}`",
                        d.name
                    )));
                }
                let t = read_dataset(d, limits, &mut total)?;
                tensors.push(t);
            }
            State { tensors, meta }
        };
        h5::close_file(f)?;
        Ok(state)
    })
}

fn walk(
    group: &hdf5::Group,
    path: &mut Vec<String>,
    found: &mut Vec<Found>,
    limits: &Limits,
) -> Result<(), H5Error> {
    if path.len() >= limits.max_depth {
        return Err(H5Error::TooLarge(format!(
            "groups nested over {} deep",
            limits.max_depth
        )));
    }
    for (link, kind) in h5::links(group, limits.max_tensors)? {
        path.push(link);
        match kind {
            LinkKind::Group => {
                let g = h5::open_group(group, path.last().expect("pushed"))?;
                walk(&g, path, found, limits)?;
            }
            LinkKind::Dataset => {
                if found.len() >= limits.max_tensors {
                    return Err(H5Error::TooLarge(format!(
                        "over {} datasets",
                        limits.max_tensors
                    )));
                }
                let ds = h5::open_dataset(group, path.last().expect("pushed"))?;
                let name = match h5::read_str_attr(&ds, ATTR_NAME, limits.max_attr_bytes)? {
                    Some(n) if !n.is_empty() => n,
                    Some(_) => {
                        return Err(H5Error::Malformed(format!(
                            "empty {ATTR_NAME} at /{}",
                            path.join("/")
                        )))
                    }
                    None => name_of(path),
                };
                let index = h5::read_u64_attr(&ds, ATTR_INDEX, 1)?
                    .map(|v| {
                        v.first()
                            .copied()
                            .ok_or_else(|| H5Error::Malformed(format!("empty {ATTR_INDEX}")))
                    })
                    .transpose()?;
                found.push(Found { name, index, ds });
            }
            LinkKind::Other(what) => {
                return Err(H5Error::Unsupported(format!(
                    "{what} at /{}",
                    path.join("/")
                )));
            }
        }
        path.pop();
    }
    Ok(())
}

/// The little-endian type a dataset of this native dtype is read as.
fn memory_type(native: DType) -> TypeDesc {
    match native {
        // A float of the bfloat16 layout (not the uint16 ckpt writes).
        DType::BF16 => TypeDesc::Float {
            bits: BFLOAT,
            little_endian: true,
        },
        d => storage(d).0,
    }
}

fn read_dataset(d: Found, limits: &Limits, total: &mut u64) -> Result<Tensor, H5Error> {
    let at = |e: H5Error| match e {
        H5Error::Unsupported(m) => H5Error::Unsupported(format!("dataset `{}`: {m}", d.name)),
        H5Error::Malformed(m) => H5Error::Malformed(format!("dataset `{}`: {m}", d.name)),
        H5Error::TooLarge(m) => H5Error::TooLarge(format!("dataset `{}`: {m}", d.name)),
        other => other,
    };
    let tid = h5::dataset_type(&d.ds)?;
    let native = classify(&ffi::describe(&tid)?).map_err(at)?;
    let shape = h5::dataset_shape(&d.ds)?;
    let ckpt_dtype = h5::read_str_attr(&d.ds, ATTR_DTYPE, 64).map_err(at)?;
    let ckpt_shape = h5::read_u64_attr(&d.ds, ATTR_SHAPE, 64).map_err(at)?;
    let (dtype, logical) =
        resolve(native, &shape, ckpt_dtype.as_deref(), ckpt_shape.as_deref()).map_err(at)?;
    let numel = logical
        .iter()
        .try_fold(1u64, |a, &x| a.checked_mul(x))
        .ok_or_else(|| at(H5Error::TooLarge(format!("shape {logical:?} overflows"))))?;
    let len = dtype
        .byte_len(numel)
        .map_err(|e| at(H5Error::TooLarge(e.to_string())))?;
    *total = total
        .checked_add(len)
        .filter(|&t| t <= limits.max_bytes)
        .ok_or_else(|| {
            H5Error::TooLarge(format!("tensors over {} bytes in all", limits.max_bytes))
        })?;
    let len = usize::try_from(len).map_err(|_| at(H5Error::TooLarge(format!("{len} bytes"))))?;
    // Read as the stored type of the native dtype, little-endian: libhdf5 converts
    // big-endian files; files of that very type are copied bit for bit.
    let mem_desc = memory_type(native);
    let stored_numel = shape.iter().try_fold(1u64, |a, &x| a.checked_mul(x));
    let fits = mem_desc
        .size()
        .and_then(|s| stored_numel?.checked_mul(s as u64))
        .is_some_and(|n| n == len as u64);
    if !fits {
        return Err(at(H5Error::Malformed(format!(
            "{len} bytes do not fill shape {shape:?}"
        ))));
    }
    let mem = ffi::make_type(&mem_desc)?;
    let data = ffi::read_dataset(&d.ds, &mem, len)?;
    Tensor::new(d.name.clone(), dtype, logical, data)
        .map_err(|e| at(H5Error::Malformed(e.to_string())))
}
