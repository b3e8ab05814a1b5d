//! The few libhdf5 calls ckpt needs, over `hdf5-sys`, with handles that close
//! themselves and errors that carry libhdf5's message.
//!
//! libhdf5 is not thread-safe: every function here must run inside
//! [`locked`], which holds the `hdf5` crate's global lock (shared with every
//! other user of that crate in the process).

use std::ffi::{CStr, CString};
use std::os::raw::{c_char, c_int, c_uint, c_void};
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};

use hdf5_sys::h5::{hsize_t, HADDR_UNDEF};
use hdf5_sys::h5a::{
    H5Aclose, H5Acreate2, H5Aexists, H5Aget_space, H5Aget_type, H5Aopen, H5Aread, H5Awrite,
};
use hdf5_sys::h5d::{
    H5D_alloc_time_t, H5D_fill_time_t, H5D_layout_t, H5Dcreate2, H5Dget_offset, H5Dget_space,
    H5Dget_storage_size, H5Dget_type, H5Dread,
};
use hdf5_sys::h5f::{H5F_libver_t, H5Fclose, H5Fcreate, H5Fopen, H5F_ACC_RDONLY, H5F_ACC_TRUNC};
use hdf5_sys::h5g::{H5Gcreate2, H5Gopen2};
use hdf5_sys::h5i::{hid_t, H5I_type_t, H5Idec_ref, H5Iget_type};
use hdf5_sys::h5l::{H5L_info1_t, H5L_type_t};
use hdf5_sys::h5o::H5Oopen;
use hdf5_sys::h5p::{
    H5Pcreate, H5Pset_alloc_time, H5Pset_fapl_core, H5Pset_file_image, H5Pset_fill_time,
    H5Pset_layout, H5Pset_libver_bounds, H5Pset_obj_track_times, H5P_CLS_DATASET_CREATE,
    H5P_CLS_FILE_ACCESS, H5P_CLS_FILE_CREATE, H5P_CLS_GROUP_CREATE, H5P_DEFAULT,
};
use hdf5_sys::h5s::{
    H5S_class_t, H5Screate, H5Screate_simple, H5Sget_simple_extent_dims,
    H5Sget_simple_extent_ndims, H5Sget_simple_extent_npoints, H5Sget_simple_extent_type, H5S_ALL,
};
use hdf5_sys::h5t::{
    H5T_class_t, H5T_cset_t, H5T_norm_t, H5T_order_t, H5T_sign_t, H5Tcopy, H5Tcreate,
    H5Tenum_create, H5Tenum_insert, H5Tget_class, H5Tget_ebias, H5Tget_fields, H5Tget_member_name,
    H5Tget_member_offset, H5Tget_member_type, H5Tget_member_value, H5Tget_nmembers, H5Tget_norm,
    H5Tget_offset, H5Tget_order, H5Tget_precision, H5Tget_sign, H5Tget_size, H5Tget_super,
    H5Tinsert, H5Tis_variable_str, H5Tset_cset, H5Tset_ebias, H5Tset_fields, H5Tset_size,
    H5T_VARIABLE,
};

use super::dtypes::{FloatBits, TypeDesc, DOUBLE, SINGLE};
use super::error::H5Error;

type Result<T> = std::result::Result<T, H5Error>;

/// Run `f` holding libhdf5's global lock (the library is initialised first).
pub fn locked<T>(f: impl FnOnce() -> T) -> T {
    ::hdf5::sync::sync(f)
}

/// An open libhdf5 identifier, released on drop.
#[derive(Debug)]
pub struct Hid(hid_t);

impl Hid {
    fn new(id: hid_t, what: &str) -> Result<Self> {
        if id < 0 {
            Err(lib_err(what))
        } else {
            Ok(Hid(id))
        }
    }

    /// The raw identifier.
    pub fn id(&self) -> hid_t {
        self.0
    }
}

impl Drop for Hid {
    fn drop(&mut self) {
        // SAFETY: the id is valid and owned; callers hold the lock (see module docs).
        unsafe {
            H5Idec_ref(self.0);
        }
    }
}

fn lib_err(what: &str) -> H5Error {
    let msg = match ::hdf5::Error::query() {
        Ok(e) | Err(e) => e.to_string(),
    };
    H5Error::Library(format!("{what}: {msg}"))
}

fn check(ret: c_int, what: &str) -> Result<()> {
    if ret < 0 {
        Err(lib_err(what))
    } else {
        Ok(())
    }
}

fn cstr(s: &str) -> Result<CString> {
    CString::new(s).map_err(|_| H5Error::Unsupported(format!("name {s:?} holds a NUL byte")))
}

fn predefined(t: &TypeDesc) -> Option<hid_t> {
    use hdf5_sys::h5t::*;
    Some(match t {
        TypeDesc::Int {
            size,
            signed,
            little_endian: true,
        } => match (size, signed) {
            (1, false) => *H5T_STD_U8LE,
            (1, true) => *H5T_STD_I8LE,
            (2, false) => *H5T_STD_U16LE,
            (2, true) => *H5T_STD_I16LE,
            (4, false) => *H5T_STD_U32LE,
            (4, true) => *H5T_STD_I32LE,
            (8, false) => *H5T_STD_U64LE,
            (8, true) => *H5T_STD_I64LE,
            _ => return None,
        },
        TypeDesc::Float {
            bits: SINGLE,
            little_endian: true,
        } => *H5T_IEEE_F32LE,
        TypeDesc::Float {
            bits: DOUBLE,
            little_endian: true,
        } => *H5T_IEEE_F64LE,
        _ => return None,
    })
}

/// A libhdf5 datatype for `t` (little-endian integer, float, enum or compound).
pub fn make_type(t: &TypeDesc) -> Result<Hid> {
    // SAFETY: plain libhdf5 calls on ids we own; the lock is held by the caller.
    unsafe {
        if let Some(id) = predefined(t) {
            return Hid::new(H5Tcopy(id), "copy type");
        }
        match t {
            TypeDesc::Float {
                bits,
                little_endian: true,
            } if bits.size == 2 => {
                // As h5py makes float16: a copy of f32 narrowed to the fields.
                let h = Hid::new(H5Tcopy(*hdf5_sys::h5t::H5T_IEEE_F32LE), "copy type")?;
                let FloatBits {
                    spos,
                    epos,
                    esize,
                    mpos,
                    msize,
                    ebias,
                    ..
                } = *bits;
                check(
                    H5Tset_fields(h.0, spos, epos, esize, mpos, msize),
                    "set float fields",
                )?;
                check(H5Tset_size(h.0, 2), "set float size")?;
                check(H5Tset_ebias(h.0, ebias as usize), "set float bias")?;
                Ok(h)
            }
            TypeDesc::Enum { base, members } => {
                let b = make_type(base)?;
                let h = Hid::new(H5Tenum_create(b.0), "create enum")?;
                for (name, v) in members {
                    let v = i8::try_from(*v)
                        .map_err(|_| H5Error::Unsupported(format!("enum value {v}")))?;
                    let n = cstr(name)?;
                    check(
                        H5Tenum_insert(h.0, n.as_ptr(), (&v as *const i8).cast()),
                        "enum member",
                    )?;
                }
                Ok(h)
            }
            TypeDesc::Compound { size, members } => {
                let h = Hid::new(
                    H5Tcreate(H5T_class_t::H5T_COMPOUND, *size),
                    "create compound",
                )?;
                for (name, off, mt) in members {
                    let m = make_type(mt)?;
                    let n = cstr(name)?;
                    check(H5Tinsert(h.0, n.as_ptr(), *off, m.0), "compound member")?;
                }
                Ok(h)
            }
            other => Err(H5Error::Unsupported(format!(
                "cannot make HDF5 type {other:?}"
            ))),
        }
    }
}

const MAX_MEMBERS: c_int = 64;
const MAX_TYPE_DEPTH: usize = 4;

fn take_name(p: *mut c_char) -> Result<String> {
    if p.is_null() {
        return Err(lib_err("member name"));
    }
    // SAFETY: libhdf5 returns a NUL-terminated string it allocated; we free it.
    unsafe {
        let s = CStr::from_ptr(p).to_string_lossy().into_owned();
        hdf5_sys::h5::H5free_memory(p.cast());
        Ok(s)
    }
}

/// Describe a libhdf5 datatype (refusing nothing: unknown shapes become [`TypeDesc::Other`]).
pub fn describe(tid: hid_t) -> Result<TypeDesc> {
    describe_at(tid, 0)
}

fn describe_at(tid: hid_t, depth: usize) -> Result<TypeDesc> {
    // SAFETY: queries on a valid type id; the lock is held by the caller.
    unsafe {
        let size = H5Tget_size(tid);
        if size == 0 {
            return Err(lib_err("type size"));
        }
        let order = H5Tget_order(tid);
        let little_endian = order == H5T_order_t::H5T_ORDER_LE;
        let plain = H5Tget_offset(tid) == 0
            && H5Tget_precision(tid) == size * 8
            && matches!(order, H5T_order_t::H5T_ORDER_LE | H5T_order_t::H5T_ORDER_BE);
        Ok(match H5Tget_class(tid) {
            H5T_class_t::H5T_INTEGER if plain => TypeDesc::Int {
                size,
                signed: H5Tget_sign(tid) == H5T_sign_t::H5T_SGN_2,
                little_endian,
            },
            H5T_class_t::H5T_FLOAT if plain && H5Tget_norm(tid) == H5T_norm_t::H5T_NORM_IMPLIED => {
                let (mut spos, mut epos, mut esize, mut mpos, mut msize) = (0, 0, 0, 0, 0);
                check(
                    H5Tget_fields(tid, &mut spos, &mut epos, &mut esize, &mut mpos, &mut msize),
                    "float fields",
                )?;
                let bits = FloatBits {
                    size,
                    spos,
                    epos,
                    esize,
                    mpos,
                    msize,
                    ebias: H5Tget_ebias(tid) as u64,
                };
                TypeDesc::Float {
                    bits,
                    little_endian,
                }
            }
            H5T_class_t::H5T_ENUM if depth < MAX_TYPE_DEPTH => {
                let base = Hid::new(H5Tget_super(tid), "enum base")?;
                let base_desc = describe_at(base.0, depth + 1)?;
                let n = H5Tget_nmembers(tid);
                let TypeDesc::Int {
                    size: bsize,
                    signed,
                    little_endian,
                } = base_desc
                else {
                    return Ok(TypeDesc::Other(format!("enum over {base_desc:?}")));
                };
                if !(0..=MAX_MEMBERS).contains(&n) {
                    return Ok(TypeDesc::Other(format!("enum of {n} members")));
                }
                let mut members = Vec::with_capacity(n as usize);
                for i in 0..n as c_uint {
                    let name = take_name(H5Tget_member_name(tid, i))?;
                    let mut raw = [0u8; 8];
                    check(
                        H5Tget_member_value(tid, i, raw.as_mut_ptr().cast()),
                        "enum value",
                    )?;
                    members.push((name, int_value(&raw[..bsize], signed, little_endian)));
                }
                TypeDesc::Enum {
                    base: Box::new(base_desc),
                    members,
                }
            }
            H5T_class_t::H5T_COMPOUND if depth < MAX_TYPE_DEPTH => {
                let n = H5Tget_nmembers(tid);
                if !(0..=MAX_MEMBERS).contains(&n) {
                    return Ok(TypeDesc::Other(format!("compound of {n} members")));
                }
                let mut members = Vec::with_capacity(n as usize);
                for i in 0..n as c_uint {
                    let name = take_name(H5Tget_member_name(tid, i))?;
                    let off = H5Tget_member_offset(tid, i);
                    let mt = Hid::new(H5Tget_member_type(tid, i), "member type")?;
                    members.push((name, off, describe_at(mt.0, depth + 1)?));
                }
                TypeDesc::Compound { size, members }
            }
            class => TypeDesc::Other(format!("{class:?} of {size} bytes")),
        })
    }
}

/// The value of a 1 to 8 byte integer in the given representation.
pub fn int_value(raw: &[u8], signed: bool, little_endian: bool) -> i64 {
    let mut b = [0u8; 8];
    let n = raw.len().min(8);
    if little_endian {
        b[..n].copy_from_slice(&raw[..n]);
    } else {
        for (i, x) in raw[..n].iter().rev().enumerate() {
            b[i] = *x;
        }
    }
    let v = u64::from_le_bytes(b);
    if signed && n > 0 && n < 8 && (v >> (n * 8 - 1)) & 1 == 1 {
        (v | (!0u64 << (n * 8))) as i64
    } else {
        v as i64
    }
}

/// Create (truncate) a file on disk, in the 1.8 file format (readable by every
/// libhdf5 since 1.8; attributes of any size).
pub fn create_file(path: &Path) -> Result<Hid> {
    let p = cstr(&path.to_string_lossy())?;
    // SAFETY: plain libhdf5 calls; the lock is held by the caller.
    unsafe {
        let fapl = Hid::new(H5Pcreate(*H5P_CLS_FILE_ACCESS), "file access list")?;
        check(
            H5Pset_libver_bounds(
                fapl.0,
                H5F_libver_t::H5F_LIBVER_V18,
                H5F_libver_t::H5F_LIBVER_V18,
            ),
            "library version bounds",
        )?;
        // No modification times in object headers: the same state gives the same
        // bytes (determinism, and content-addressed reuse downstream).
        let fcpl = Hid::new(H5Pcreate(*H5P_CLS_FILE_CREATE), "file create list")?;
        check(H5Pset_obj_track_times(fcpl.0, 0), "no object times")?;
        Hid::new(
            H5Fcreate(p.as_ptr(), H5F_ACC_TRUNC, fcpl.0, fapl.0),
            "create file",
        )
    }
}

/// Open a file on disk, read-only.
pub fn open_file(path: &Path) -> Result<Hid> {
    let p = cstr(&path.to_string_lossy())?;
    // SAFETY: plain libhdf5 call; the lock is held by the caller.
    unsafe {
        Hid::new(
            H5Fopen(p.as_ptr(), H5F_ACC_RDONLY, H5P_DEFAULT),
            "open file",
        )
    }
}

/// Open a file image in memory, read-only (libhdf5 copies it).
pub fn open_image(bytes: &[u8]) -> Result<Hid> {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    // A unique name: libhdf5 would take a second open of the same name for the same file.
    let name = cstr(&format!(
        "ckpt-image-{}",
        NEXT.fetch_add(1, Ordering::Relaxed)
    ))?;
    // SAFETY: libhdf5 copies the image (no callbacks set) before we return.
    unsafe {
        let fapl = Hid::new(H5Pcreate(*H5P_CLS_FILE_ACCESS), "file access list")?;
        check(H5Pset_fapl_core(fapl.0, 1 << 16, 0), "core driver")?;
        check(
            H5Pset_file_image(fapl.0, bytes.as_ptr() as *mut c_void, bytes.len()),
            "file image",
        )?;
        Hid::new(
            H5Fopen(name.as_ptr(), H5F_ACC_RDONLY, fapl.0),
            "open file image",
        )
    }
}

/// Close a file, reporting failures (flushing metadata happens here).
pub fn close_file(f: Hid) -> Result<()> {
    let id = f.0;
    std::mem::forget(f);
    // SAFETY: we owned the id and give it up here.
    unsafe { check(H5Fclose(id), "close file") }
}

/// Create a group `name` in `loc`.
pub fn create_group(loc: &Hid, name: &str) -> Result<Hid> {
    let n = cstr(name)?;
    // SAFETY: plain libhdf5 call; the lock is held by the caller.
    unsafe {
        let gcpl = Hid::new(H5Pcreate(*H5P_CLS_GROUP_CREATE), "group create list")?;
        check(H5Pset_obj_track_times(gcpl.0, 0), "no object times")?;
        Hid::new(
            H5Gcreate2(loc.0, n.as_ptr(), H5P_DEFAULT, gcpl.0, H5P_DEFAULT),
            "create group",
        )
    }
}

/// Open the root group of a file.
pub fn root(file: &Hid) -> Result<Hid> {
    // SAFETY: plain libhdf5 call; the lock is held by the caller.
    unsafe {
        Hid::new(
            H5Gopen2(file.0, c"/".as_ptr(), H5P_DEFAULT),
            "open root group",
        )
    }
}

/// A dataspace: scalar for an empty shape, simple otherwise.
fn space(shape: &[u64]) -> Result<Hid> {
    // SAFETY: dims outlives the call; the lock is held by the caller.
    unsafe {
        if shape.is_empty() {
            Hid::new(H5Screate(H5S_class_t::H5S_SCALAR), "scalar dataspace")
        } else {
            let dims: Vec<hsize_t> = shape.to_vec();
            let rank = c_int::try_from(dims.len())
                .map_err(|_| H5Error::TooLarge(format!("{} dimensions", dims.len())))?;
            Hid::new(
                H5Screate_simple(rank, dims.as_ptr(), std::ptr::null()),
                "dataspace",
            )
        }
    }
}

/// Create a contiguous, uncompressed dataset whose storage is allocated now and
/// never filled: libhdf5 reserves the bytes and writes none of them. Returns the
/// dataset and the file offset of its bytes (`None` when it has no storage).
pub fn create_dataset(
    loc: &Hid,
    name: &str,
    t: &Hid,
    shape: &[u64],
    len: u64,
) -> Result<(Hid, Option<u64>)> {
    let n = cstr(name)?;
    let s = space(shape)?;
    // SAFETY: plain libhdf5 calls on ids we own; the lock is held by the caller.
    unsafe {
        let dcpl = Hid::new(H5Pcreate(*H5P_CLS_DATASET_CREATE), "dataset create list")?;
        check(
            H5Pset_layout(dcpl.0, H5D_layout_t::H5D_CONTIGUOUS),
            "contiguous layout",
        )?;
        check(
            H5Pset_alloc_time(dcpl.0, H5D_alloc_time_t::H5D_ALLOC_TIME_EARLY),
            "allocation time",
        )?;
        check(
            H5Pset_fill_time(dcpl.0, H5D_fill_time_t::H5D_FILL_TIME_NEVER),
            "fill time",
        )?;
        check(H5Pset_obj_track_times(dcpl.0, 0), "no object times")?;
        let d = Hid::new(
            H5Dcreate2(
                loc.0,
                n.as_ptr(),
                t.0,
                s.0,
                H5P_DEFAULT,
                dcpl.0,
                H5P_DEFAULT,
            ),
            "create dataset",
        )?;
        if len == 0 {
            return Ok((d, None));
        }
        let off = H5Dget_offset(d.0);
        let stored = H5Dget_storage_size(d.0);
        if off == HADDR_UNDEF || stored != len {
            return Err(H5Error::Library(format!(
                "dataset `{name}`: {stored} bytes allocated at {off:#x}, expected {len} contiguous bytes"
            )));
        }
        Ok((d, Some(off)))
    }
}

fn string_type() -> Result<Hid> {
    // SAFETY: plain libhdf5 calls; the lock is held by the caller.
    unsafe {
        let t = Hid::new(H5Tcopy(*hdf5_sys::h5t::H5T_C_S1), "string type")?;
        check(H5Tset_size(t.0, H5T_VARIABLE), "variable string")?;
        check(H5Tset_cset(t.0, H5T_cset_t::H5T_CSET_UTF8), "utf-8 string")?;
        Ok(t)
    }
}

struct Attr(hid_t);

impl Drop for Attr {
    fn drop(&mut self) {
        // SAFETY: the attribute id is valid and owned.
        unsafe {
            H5Aclose(self.0);
        }
    }
}

fn new_attr(obj: &Hid, name: &str, t: hid_t, s: hid_t) -> Result<Attr> {
    let n = cstr(name)?;
    // SAFETY: plain libhdf5 call; the lock is held by the caller.
    let a = unsafe { H5Acreate2(obj.0, n.as_ptr(), t, s, H5P_DEFAULT, H5P_DEFAULT) };
    if a < 0 {
        return Err(lib_err(&format!("create attribute `{name}`")));
    }
    Ok(Attr(a))
}

/// Write a scalar UTF-8 string attribute (variable length, as h5py writes `str`).
pub fn write_str_attr(obj: &Hid, name: &str, value: &str) -> Result<()> {
    let v = cstr(value)?;
    let t = string_type()?;
    let s = space(&[])?;
    let a = new_attr(obj, name, t.0, s.0)?;
    let ptr = v.as_ptr();
    // SAFETY: a variable-length string is written from a pointer to a C string.
    unsafe {
        check(
            H5Awrite(a.0, t.0, (&ptr as *const *const c_char).cast()),
            "write attribute",
        )
    }
}

/// Write a `u64` attribute: a scalar, or a 1-d array when `dims` is given.
pub fn write_u64_attr(obj: &Hid, name: &str, values: &[u64], array: bool) -> Result<()> {
    let s = if array {
        space(&[values.len() as u64])?
    } else {
        space(&[])?
    };
    let t = make_type(&TypeDesc::Int {
        size: 8,
        signed: false,
        little_endian: true,
    })?;
    let a = new_attr(obj, name, t.0, s.0)?;
    let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
    // SAFETY: the buffer holds every element in the attribute's own type.
    unsafe { check(H5Awrite(a.0, t.0, bytes.as_ptr().cast()), "write attribute") }
}

fn open_attr(obj: hid_t, name: &str) -> Result<Option<Attr>> {
    let n = cstr(name)?;
    // SAFETY: plain libhdf5 calls; the lock is held by the caller.
    unsafe {
        let exists = H5Aexists(obj, n.as_ptr());
        if exists < 0 {
            return Err(lib_err("attribute lookup"));
        }
        if exists == 0 {
            return Ok(None);
        }
        let a = H5Aopen(obj, n.as_ptr(), H5P_DEFAULT);
        if a < 0 {
            return Err(lib_err(&format!("open attribute `{name}`")));
        }
        Ok(Some(Attr(a)))
    }
}

fn attr_points(a: &Attr) -> Result<i64> {
    // SAFETY: plain libhdf5 calls; the lock is held by the caller.
    unsafe {
        let s = Hid::new(H5Aget_space(a.0), "attribute space")?;
        let n = H5Sget_simple_extent_npoints(s.0);
        if n < 0 {
            return Err(lib_err("attribute space"));
        }
        Ok(n)
    }
}

/// Read a scalar string attribute (variable or fixed length), at most `cap` bytes.
pub fn read_str_attr(obj: hid_t, name: &str, cap: usize) -> Result<Option<String>> {
    let Some(a) = open_attr(obj, name)? else {
        return Ok(None);
    };
    let bad = |why: &str| H5Error::Malformed(format!("attribute `{name}`: {why}"));
    if attr_points(&a)? != 1 {
        return Err(bad("not a scalar"));
    }
    // SAFETY: reads into buffers of the size libhdf5 reports; vlen memory is freed.
    unsafe {
        let t = Hid::new(H5Aget_type(a.0), "attribute type")?;
        if H5Tget_class(t.0) != H5T_class_t::H5T_STRING {
            return Err(bad("not a string"));
        }
        let raw = if H5Tis_variable_str(t.0) > 0 {
            let mt = string_type()?;
            let mut p: *mut c_char = std::ptr::null_mut();
            check(
                H5Aread(a.0, mt.0, (&mut p as *mut *mut c_char).cast()),
                "read attribute",
            )?;
            if p.is_null() {
                return Err(bad("null string"));
            }
            let bytes = CStr::from_ptr(p).to_bytes();
            let out = (bytes.len() <= cap).then(|| bytes.to_vec());
            hdf5_sys::h5::H5free_memory(p.cast());
            out.ok_or_else(|| H5Error::TooLarge(format!("attribute `{name}` over {cap} bytes")))?
        } else {
            let size = H5Tget_size(t.0);
            if size > cap {
                return Err(H5Error::TooLarge(format!(
                    "attribute `{name}` over {cap} bytes"
                )));
            }
            let mut buf = vec![0u8; size];
            check(H5Aread(a.0, t.0, buf.as_mut_ptr().cast()), "read attribute")?;
            let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
            buf.truncate(end);
            while buf.last() == Some(&b' ') {
                buf.pop();
            }
            buf
        };
        String::from_utf8(raw)
            .map(Some)
            .map_err(|_| bad("not UTF-8"))
    }
}

/// Read an integer attribute of at most `cap` elements as `u64`s.
pub fn read_u64_attr(obj: hid_t, name: &str, cap: usize) -> Result<Option<Vec<u64>>> {
    let Some(a) = open_attr(obj, name)? else {
        return Ok(None);
    };
    let n = attr_points(&a)?;
    let n = usize::try_from(n)
        .ok()
        .filter(|&n| n <= cap)
        .ok_or_else(|| H5Error::TooLarge(format!("attribute `{name}` of {n} elements")))?;
    // SAFETY: the buffer holds n u64s; libhdf5 converts the integer type into it.
    unsafe {
        let t = Hid::new(H5Aget_type(a.0), "attribute type")?;
        match describe(t.0)? {
            TypeDesc::Int { signed: false, .. } => {}
            other => {
                return Err(H5Error::Malformed(format!(
                    "attribute `{name}` is {other:?}, not an unsigned integer"
                )))
            }
        }
        let mt = make_type(&TypeDesc::Int {
            size: 8,
            signed: false,
            little_endian: true,
        })?;
        let mut buf = vec![0u8; n * 8];
        check(
            H5Aread(a.0, mt.0, buf.as_mut_ptr().cast()),
            "read attribute",
        )?;
        Ok(Some(
            buf.chunks_exact(8)
                .map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes")))
                .collect(),
        ))
    }
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

struct Links {
    names: Vec<String>,
    kinds: Vec<H5L_type_t>,
    cap: usize,
    over: bool,
}

#[allow(deprecated)] // H5Literate1: the same symbol on every libhdf5 since 1.8
unsafe extern "C" fn collect_link(
    _g: hid_t,
    name: *const c_char,
    info: *const H5L_info1_t,
    data: *mut c_void,
) -> c_int {
    // SAFETY: libhdf5 passes valid pointers; `data` is the `Links` we gave it.
    let links = &mut *(data as *mut Links);
    if links.names.len() >= links.cap {
        links.over = true;
        return 1;
    }
    links
        .names
        .push(CStr::from_ptr(name).to_string_lossy().into_owned());
    links.kinds.push((*info).type_);
    0
}

/// The links of a group, in name order, at most `cap` of them.
pub fn links(group: &Hid, cap: usize) -> Result<Vec<(String, LinkKind)>> {
    let mut l = Links {
        names: Vec::new(),
        kinds: Vec::new(),
        cap,
        over: false,
    };
    // SAFETY: the callback only touches `l`, which outlives the call.
    #[allow(deprecated)]
    unsafe {
        let mut idx: hsize_t = 0;
        check(
            hdf5_sys::h5l::H5Literate1(
                group.0,
                hdf5_sys::h5::H5_index_t::H5_INDEX_NAME,
                hdf5_sys::h5::H5_iter_order_t::H5_ITER_INC,
                &mut idx,
                Some(collect_link),
                (&mut l as *mut Links).cast(),
            ),
            "list group",
        )?;
    }
    if l.over {
        return Err(H5Error::TooLarge(format!("a group of over {cap} links")));
    }
    let mut out = Vec::with_capacity(l.names.len());
    for (name, kind) in l.names.into_iter().zip(l.kinds) {
        let kind = match kind {
            H5L_type_t::H5L_TYPE_HARD => match object_type(group, &name)? {
                H5I_type_t::H5I_GROUP => LinkKind::Group,
                H5I_type_t::H5I_DATASET => LinkKind::Dataset,
                _ => LinkKind::Other("named datatype"),
            },
            H5L_type_t::H5L_TYPE_SOFT => LinkKind::Other("soft link"),
            H5L_type_t::H5L_TYPE_EXTERNAL => LinkKind::Other("external link"),
            _ => LinkKind::Other("user-defined link"),
        };
        out.push((name, kind));
    }
    Ok(out)
}

fn object_type(group: &Hid, name: &str) -> Result<H5I_type_t> {
    let o = open(group, name)?;
    // SAFETY: a valid id; the lock is held by the caller.
    Ok(unsafe { H5Iget_type(o.0) })
}

/// Open the object a hard link of `group` leads to.
pub fn open(group: &Hid, name: &str) -> Result<Hid> {
    let n = cstr(name)?;
    // SAFETY: plain libhdf5 call; the lock is held by the caller.
    unsafe {
        Hid::new(
            H5Oopen(group.0, n.as_ptr(), H5P_DEFAULT),
            &format!("open `{name}`"),
        )
    }
}

/// A dataset's datatype.
pub fn dataset_type(d: &Hid) -> Result<Hid> {
    // SAFETY: plain libhdf5 call; the lock is held by the caller.
    unsafe { Hid::new(H5Dget_type(d.0), "dataset type") }
}

/// A dataset's shape (empty for a scalar); a null dataspace is refused.
pub fn dataset_shape(d: &Hid) -> Result<Vec<u64>> {
    // SAFETY: dims has room for `rank` entries; the lock is held by the caller.
    unsafe {
        let s = Hid::new(H5Dget_space(d.0), "dataset space")?;
        match H5Sget_simple_extent_type(s.0) {
            H5S_class_t::H5S_SCALAR => Ok(Vec::new()),
            H5S_class_t::H5S_SIMPLE => {
                let rank = H5Sget_simple_extent_ndims(s.0);
                let rank = usize::try_from(rank).map_err(|_| lib_err("dataset rank"))?;
                let mut dims = vec![0 as hsize_t; rank];
                check(
                    H5Sget_simple_extent_dims(s.0, dims.as_mut_ptr(), std::ptr::null_mut()),
                    "dataset dims",
                )?;
                Ok(dims)
            }
            _ => Err(H5Error::Unsupported(
                "a dataset with a null dataspace".into(),
            )),
        }
    }
}

/// Read a whole dataset, converted by libhdf5 into `mem` (exactly `len` bytes).
pub fn read_dataset(d: &Hid, mem: &Hid, len: usize) -> Result<Vec<u8>> {
    let mut buf = vec![0u8; len];
    if len > 0 {
        // SAFETY: the buffer holds every element in the memory type (checked by the caller).
        unsafe {
            check(
                H5Dread(
                    d.0,
                    mem.0,
                    H5S_ALL,
                    H5S_ALL,
                    H5P_DEFAULT,
                    buf.as_mut_ptr().cast(),
                ),
                "read dataset",
            )?;
        }
    }
    Ok(buf)
}
