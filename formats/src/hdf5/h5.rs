//! The libhdf5 operations ckpt needs that hdf5-metno's safe API covers: files,
//! groups, link walking, datasets (created with a datatype [`super::ffi`] built),
//! shapes and attributes. What it cannot do is in [`super::ffi`], with the reason.
//!
//! Every property ckpt sets is spelled out, so the files are the same bytes as
//! those written through the C API directly: 1.8 file format, no object times,
//! ASCII link and attribute names (the library's default, which hdf5-metno's
//! attribute builder would otherwise change to UTF-8), contiguous datasets.

use std::path::Path;

use hdf5::dataset::Layout;
use hdf5::file::LibraryVersion;
use hdf5::plist::dataset_create::{AllocTime, FillTime};
use hdf5::plist::link_create::CharEncoding;
use hdf5::types::{TypeDescriptor, VarLenAscii, VarLenUnicode};
use hdf5::{
    Attribute, Dataset, Datatype, File, Group, IndexType, IterationOrder, LinkType, Location,
    LocationType, SimpleExtents,
};

use super::dtypes::TypeDesc;
use super::error::H5Error;
use super::ffi;

type Result<T> = std::result::Result<T, H5Error>;

/// libhdf5's failure of `what`, with hdf5-metno's message.
fn lib(what: &str) -> impl FnOnce(hdf5::Error) -> H5Error + '_ {
    move |e| H5Error::Library(format!("{what}: {e}"))
}

/// Create (truncate) a file on disk, in the 1.8 file format (readable by every
/// libhdf5 since 1.8; attributes of any size).
pub fn create_file(path: &Path) -> Result<File> {
    File::with_options()
        .with_fapl(|p| p.libver_bounds(LibraryVersion::V18, LibraryVersion::V18))
        // No modification times in object headers: the same state gives the same
        // bytes (determinism, and content-addressed reuse downstream).
        .with_fcpl(|p| p.obj_track_times(false))
        .create(path)
        .map_err(lib("create file"))
}

/// Open a file on disk, read-only.
pub fn open_file(path: &Path) -> Result<File> {
    File::open(path).map_err(lib("open file"))
}

/// Close a file, reporting failures (flushing metadata happens here).
pub fn close_file(f: File) -> Result<()> {
    f.close().map_err(lib("close file"))
}

/// Open the root group of a file.
pub fn root(file: &File) -> Result<Group> {
    file.group("/").map_err(lib("open root group"))
}

/// Create a group `name` in `loc`.
pub fn create_group(loc: &Group, name: &str) -> Result<Group> {
    loc.create_group_builder()
        .obj_track_times(false)
        .create_intermediate_group(false)
        .create(name)
        .map_err(lib("create group"))
}

fn extents(shape: &[u64]) -> Result<SimpleExtents> {
    let dims = shape
        .iter()
        .map(|&d| usize::try_from(d))
        .collect::<std::result::Result<Vec<usize>, _>>()
        .map_err(|_| H5Error::TooLarge(format!("shape {shape:?}")))?;
    Ok(SimpleExtents::fixed(dims))
}

/// Create a contiguous, uncompressed dataset whose storage is allocated now and
/// never filled: libhdf5 reserves the bytes and writes none of them. Returns the
/// dataset and the file offset of its bytes (`None` when it has no storage).
pub fn create_dataset(
    loc: &Group,
    name: &str,
    t: &Datatype,
    shape: &[u64],
    len: u64,
) -> Result<(Dataset, Option<u64>)> {
    let d = loc
        .new_dataset_builder()
        .empty_as(t)
        // Contiguous even when empty (the builder would chunk an empty dataset).
        .no_chunk()
        .layout(Layout::Contiguous)
        .alloc_time(Some(AllocTime::Early))
        .fill_time(FillTime::Never)
        .obj_track_times(false)
        .create_intermediate_group(false)
        .shape(extents(shape)?)
        .create(name)
        .map_err(lib("create dataset"))?;
    if len == 0 {
        return Ok((d, None));
    }
    let stored = d.storage_size();
    match d.offset() {
        Some(off) if stored == len => Ok((d, Some(off))),
        off => Err(H5Error::Library(format!(
            "dataset `{name}`: {stored} bytes allocated at {off:?}, expected {len} contiguous bytes"
        ))),
    }
}

/// Write a scalar UTF-8 string attribute (variable length, as h5py writes `str`).
pub fn write_str_attr(obj: &Location, name: &str, value: &str) -> Result<()> {
    let v: VarLenUnicode = value
        .parse()
        .map_err(|_| H5Error::Unsupported(format!("attribute `{name}` holds a NUL byte")))?;
    obj.new_attr::<VarLenUnicode>()
        .char_encoding(CharEncoding::Ascii)
        .create(name)
        .and_then(|a| a.write_scalar(&v))
        .map_err(lib("write attribute"))
}

/// Write a little-endian `u64` attribute: a scalar, or a 1-d array when `array`.
pub fn write_u64_attr(obj: &Location, name: &str, values: &[u64], array: bool) -> Result<()> {
    let t = ffi::make_type(&TypeDesc::Int {
        size: 8,
        signed: false,
        little_endian: true,
    })?;
    let b = obj
        .new_attr_builder()
        .empty_as(&t)
        .char_encoding(CharEncoding::Ascii);
    let a = if array {
        b.shape(extents(&[values.len() as u64])?).create(name)
    } else {
        b.create(name)
    };
    a.and_then(|a| a.write_raw(values))
        .map_err(lib("write attribute"))
}

/// The attribute `name` of `obj`, if it has one.
fn open_attr(obj: &Location, name: &str) -> Result<Option<Attribute>> {
    let found = obj
        .find_attr(IndexType::Name, IterationOrder::Native, |n, _| {
            Ok((n == name).then_some(()))
        })
        .map_err(lib("attribute lookup"))?;
    match found {
        Some(()) => obj
            .attr(name)
            .map(Some)
            .map_err(lib(&format!("open attribute `{name}`"))),
        None => Ok(None),
    }
}

/// Read a scalar string attribute (variable or fixed length), at most `cap` bytes.
pub fn read_str_attr(obj: &Location, name: &str, cap: usize) -> Result<Option<String>> {
    let Some(a) = open_attr(obj, name)? else {
        return Ok(None);
    };
    let bad = |why: &str| H5Error::Malformed(format!("attribute `{name}`: {why}"));
    let space = a.space().map_err(lib("attribute space"))?;
    if space.size() != 1 {
        return Err(bad("not a scalar"));
    }
    let over = || H5Error::TooLarge(format!("attribute `{name}` over {cap} bytes"));
    let t = a.dtype().map_err(lib("attribute type"))?;
    // One element (a scalar, or an array of one), read as a vector to take either.
    let raw = match t.to_descriptor() {
        Ok(TypeDescriptor::VarLenUnicode) => {
            let v = a
                .read_raw::<VarLenUnicode>()
                .map_err(lib("read attribute"))?;
            v.first().map(|s| s.as_bytes().to_vec()).unwrap_or_default()
        }
        Ok(TypeDescriptor::VarLenAscii) => {
            let v = a.read_raw::<VarLenAscii>().map_err(lib("read attribute"))?;
            v.first().map(|s| s.as_bytes().to_vec()).unwrap_or_default()
        }
        Ok(TypeDescriptor::FixedAscii(size) | TypeDescriptor::FixedUnicode(size)) => {
            if size > cap {
                return Err(over());
            }
            let mut buf = ffi::read_fixed_str(&a, &t, size)?;
            let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
            buf.truncate(end);
            while buf.last() == Some(&b' ') {
                buf.pop();
            }
            buf
        }
        _ => return Err(bad("not a string")),
    };
    if raw.len() > cap {
        return Err(over());
    }
    String::from_utf8(raw)
        .map(Some)
        .map_err(|_| bad("not UTF-8"))
}

/// Read an unsigned integer attribute of at most `cap` elements as `u64`s.
pub fn read_u64_attr(obj: &Location, name: &str, cap: usize) -> Result<Option<Vec<u64>>> {
    let Some(a) = open_attr(obj, name)? else {
        return Ok(None);
    };
    let n = a.space().map_err(lib("attribute space"))?.size();
    if n > cap {
        return Err(H5Error::TooLarge(format!(
            "attribute `{name}` of {n} elements"
        )));
    }
    let t = a.dtype().map_err(lib("attribute type"))?;
    match ffi::describe(&t)? {
        TypeDesc::Int { signed: false, .. } => {}
        other => {
            return Err(H5Error::Malformed(format!(
                "attribute `{name}` is {other:?}, not an unsigned integer"
            )))
        }
    }
    a.read_raw::<u64>().map(Some).map_err(lib("read attribute"))
}

/// What a link of a group leads to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LinkKind {
    /// A hard link to a group.
    Group,
    /// A hard link to a dataset.
    Dataset,
    /// Anything else: a soft or external link, a named datatype.
    Other(&'static str),
}

/// The links of a group, in name order, at most `cap` of them.
pub fn links(group: &Group, cap: usize) -> Result<Vec<(String, LinkKind)>> {
    let mut found = Vec::new();
    let over = group
        .find_link(IndexType::Name, IterationOrder::Increasing, |name, info| {
            if found.len() >= cap {
                return Ok(Some(()));
            }
            found.push((name.to_owned(), info.link_type));
            Ok(None)
        })
        .map_err(lib("list group"))?;
    if over.is_some() {
        return Err(H5Error::TooLarge(format!("a group of over {cap} links")));
    }
    let mut out = Vec::with_capacity(found.len());
    for (name, link) in found {
        let kind = match link {
            LinkType::Hard => match group
                .loc_type_by_name(&name)
                .map_err(lib(&format!("open `{name}`")))?
            {
                LocationType::Group => LinkKind::Group,
                LocationType::Dataset => LinkKind::Dataset,
                _ => LinkKind::Other("named datatype"),
            },
            LinkType::Soft => LinkKind::Other("soft link"),
            // hdf5-metno reports user-defined links as external too.
            LinkType::External => LinkKind::Other("external or user-defined link"),
        };
        out.push((name, kind));
    }
    Ok(out)
}

/// Open the group a hard link of `group` leads to.
pub fn open_group(group: &Group, name: &str) -> Result<Group> {
    group.group(name).map_err(lib(&format!("open `{name}`")))
}

/// Open the dataset a hard link of `group` leads to.
pub fn open_dataset(group: &Group, name: &str) -> Result<Dataset> {
    group.dataset(name).map_err(lib(&format!("open `{name}`")))
}

/// A dataset's datatype.
pub fn dataset_type(d: &Dataset) -> Result<Datatype> {
    d.dtype().map_err(lib("dataset type"))
}

/// A dataset's shape (empty for a scalar); a null dataspace is refused.
pub fn dataset_shape(d: &Dataset) -> Result<Vec<u64>> {
    let s = d.space().map_err(lib("dataset space"))?;
    if s.is_null() {
        return Err(H5Error::Unsupported(
            "a dataset with a null dataspace".into(),
        ));
    }
    Ok(s.shape().into_iter().map(|d| d as u64).collect())
}

#[cfg(test)]
mod tests {
    use ckpt_core::DType;
    use hdf5::types::{FixedAscii, FixedUnicode};

    use super::super::read::{read_with, Limits, Source};
    use super::*;

    /// A file as other tools write it: the attributes ckpt reads, as fixed-length
    /// and ASCII strings (h5py writes `numpy.bytes_` attributes that way).
    fn foreign(path: &Path) -> hdf5::Result<()> {
        let f = File::create(path)?;
        let meta = serde_json::to_string(&meta()).unwrap();
        f.new_attr::<FixedUnicode<64>>()
            .create("ckpt_meta")?
            .write_scalar(&meta.parse::<FixedUnicode<64>>().unwrap())?;
        let w = f.new_dataset::<u16>().shape([2]).create("w")?;
        w.write_raw(&[1u16, 2])?;
        w.new_attr::<FixedAscii<8>>()
            .create("ckpt_dtype")?
            .write_scalar(&FixedAscii::<8>::from_ascii("BF16").unwrap())?;
        let x = f.new_dataset::<u8>().shape([1]).create("x")?;
        x.write_raw(&[9u8])?;
        x.new_attr::<VarLenAscii>()
            .create("ckpt_name")?
            .write_scalar(&VarLenAscii::from_ascii("a/b").unwrap())?;
        f.close()
    }

    fn meta() -> ckpt_core::Value {
        ckpt_core::Value::map([("step", ckpt_core::Value::Int(7))])
    }

    #[test]
    fn fixed_length_and_ascii_string_attributes_are_read() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("foreign.h5");
        foreign(&p).unwrap();
        let s = read_with(Source::Path(&p), &Limits::default()).unwrap();
        let got: Vec<(&str, DType, &[u8])> = s
            .tensors
            .iter()
            .map(|t| (t.name.as_str(), t.dtype, &t.data[..]))
            .collect();
        assert_eq!(
            got,
            // In path order (`/w`, `/x`), there being no `ckpt_index`.
            [
                ("w", DType::BF16, &[1u8, 0, 2, 0][..]),
                ("a/b", DType::U8, &[9u8][..])
            ]
        );
        assert_eq!(s.meta, meta());
        // A fixed-length string wider than the cap is refused before it is read.
        let tight = Limits {
            max_attr_bytes: 63,
            ..Limits::default()
        };
        assert!(matches!(
            read_with(Source::Path(&p), &tight),
            Err(H5Error::TooLarge(_))
        ));
    }

    #[test]
    fn string_attributes_that_are_not_one_string_are_malformed() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("two.h5");
        let f = File::create(&p).unwrap();
        f.new_attr::<VarLenUnicode>()
            .shape([2])
            .create("ckpt_meta")
            .unwrap();
        f.close().unwrap();
        assert!(matches!(
            read_with(Source::Path(&p), &Limits::default()),
            Err(H5Error::Malformed(_))
        ));
        let f = File::create(&p).unwrap();
        f.new_attr::<u32>().create("ckpt_meta").unwrap();
        f.close().unwrap();
        assert!(matches!(
            read_with(Source::Path(&p), &Limits::default()),
            Err(H5Error::Malformed(_))
        ));
    }
}
