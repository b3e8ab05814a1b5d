//! What hdf5-metno's safe API cannot do, over `hdf5-sys`, each with the reason:
//!
//! - datatypes ckpt builds ([`make_type`]) and inspects ([`describe`]): custom
//!   float layouts (float16 as h5py makes it, bfloat16 read natively) that the
//!   safe type system cannot describe, with the byte order fixed to
//!   little-endian whatever the host (the safe types follow the host);
//! - in-memory file images ([`open_image`]), which the safe API leaves out on
//!   purpose;
//! - reads into those custom memory types ([`read_dataset`]) and of fixed-length
//!   strings of a width known only at run time ([`read_fixed_str`]): the safe
//!   read needs a Rust type with an HDF5 mapping.
//!
//! Everything else is in [`super::h5`], on the safe API. Objects made here are
//! handed over as hdf5-metno objects (which close themselves).
//!
//! libhdf5 is not thread-safe: every function here must run inside
//! [`locked`], which holds the `hdf5` crate's global lock (shared with every
//! other user of that crate in the process).

use std::ffi::{CStr, CString};
use std::os::raw::{c_char, c_int, c_uint, c_void};
use std::sync::atomic::{AtomicU64, Ordering};

use hdf5::{Attribute, Dataset, Datatype, File};
use hdf5_sys::h5a::H5Aread;
use hdf5_sys::h5d::H5Dread;
use hdf5_sys::h5f::{H5Fopen, H5F_ACC_RDONLY};
use hdf5_sys::h5i::hid_t;
use hdf5_sys::h5p::{
    H5Pcreate, H5Pset_fapl_core, H5Pset_file_image, H5P_CLS_FILE_ACCESS, H5P_DEFAULT,
};
use hdf5_sys::h5s::H5S_ALL;
use hdf5_sys::h5t::{
    H5T_class_t, H5T_norm_t, H5T_order_t, H5T_sign_t, H5Tcopy, H5Tcreate, H5Tenum_create,
    H5Tenum_insert, H5Tget_class, H5Tget_ebias, H5Tget_fields, H5Tget_member_name,
    H5Tget_member_offset, H5Tget_member_type, H5Tget_member_value, H5Tget_nmembers, H5Tget_norm,
    H5Tget_offset, H5Tget_order, H5Tget_precision, H5Tget_sign, H5Tget_size, H5Tget_super,
    H5Tinsert, H5Tset_ebias, H5Tset_fields, H5Tset_size,
};

use super::dtypes::{FloatBits, TypeDesc, DOUBLE, SINGLE};
use super::error::H5Error;

type Result<T> = std::result::Result<T, H5Error>;

/// Run `f` holding libhdf5's global lock (the library is initialised first).
pub fn locked<T>(f: impl FnOnce() -> T) -> T {
    ::hdf5::sync::sync(f)
}

/// Take ownership of a datatype id libhdf5 just returned (negative: its error).
fn datatype(id: hid_t, what: &str) -> Result<Datatype> {
    if id < 0 {
        return Err(lib_err(what));
    }
    // SAFETY: `id` is a datatype id libhdf5 just created for us, with one reference
    // that nothing else holds: the `Datatype` takes it over and releases it on drop.
    unsafe { hdf5::from_id(id) }.map_err(|e| H5Error::Library(format!("{what}: {e}")))
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
pub fn make_type(t: &TypeDesc) -> Result<Datatype> {
    // SAFETY: libhdf5 calls on datatype ids we own (each held by a `Datatype`, or a
    // predefined one we only copy), names that are C strings outliving the call,
    // and enum values of one byte, the size of their base (checked by the match);
    // the lock is held by the caller.
    unsafe {
        if let Some(id) = predefined(t) {
            return datatype(H5Tcopy(id), "copy type");
        }
        match t {
            TypeDesc::Float {
                bits,
                little_endian: true,
            } if bits.size == 2 => {
                // As h5py makes float16: a copy of f32 narrowed to the fields.
                let h = datatype(H5Tcopy(*hdf5_sys::h5t::H5T_IEEE_F32LE), "copy type")?;
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
                    H5Tset_fields(h.id(), spos, epos, esize, mpos, msize),
                    "set float fields",
                )?;
                check(H5Tset_size(h.id(), 2), "set float size")?;
                check(H5Tset_ebias(h.id(), ebias as usize), "set float bias")?;
                Ok(h)
            }
            TypeDesc::Enum { base, members } if base.size() == Some(1) => {
                let b = make_type(base)?;
                let h = datatype(H5Tenum_create(b.id()), "create enum")?;
                for (name, v) in members {
                    let v = i8::try_from(*v)
                        .map_err(|_| H5Error::Unsupported(format!("enum value {v}")))?;
                    let n = cstr(name)?;
                    check(
                        H5Tenum_insert(h.id(), n.as_ptr(), (&v as *const i8).cast()),
                        "enum member",
                    )?;
                }
                Ok(h)
            }
            TypeDesc::Compound { size, members } => {
                let h = datatype(
                    H5Tcreate(H5T_class_t::H5T_COMPOUND, *size),
                    "create compound",
                )?;
                for (name, off, mt) in members {
                    let m = make_type(mt)?;
                    let n = cstr(name)?;
                    check(
                        H5Tinsert(h.id(), n.as_ptr(), *off, m.id()),
                        "compound member",
                    )?;
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
pub fn describe(t: &Datatype) -> Result<TypeDesc> {
    describe_at(t.id(), 0)
}

fn describe_at(tid: hid_t, depth: usize) -> Result<TypeDesc> {
    // SAFETY: queries on a valid datatype id (held by the caller's `Datatype`, or by
    // one made here for a base or member type), writing only into locals of the
    // sizes libhdf5 expects (at most 8 bytes for an enum value: the base is an
    // integer of at most 8 bytes, checked first); the lock is held by the caller.
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
                let base = datatype(H5Tget_super(tid), "enum base")?;
                let base_desc = describe_at(base.id(), depth + 1)?;
                let n = H5Tget_nmembers(tid);
                // At most 8 bytes: each value is read into an 8-byte buffer.
                let TypeDesc::Int {
                    size: bsize @ 1..=8,
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
                    let mt = datatype(H5Tget_member_type(tid, i), "member type")?;
                    members.push((name, off, describe_at(mt.id(), depth + 1)?));
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

/// Open a file image in memory, read-only (libhdf5 copies it). The safe API
/// leaves file images out on purpose, so this stays here.
pub fn open_image(bytes: &[u8]) -> Result<File> {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    // A unique name: libhdf5 would take a second open of the same name for the same file.
    let name = cstr(&format!(
        "ckpt-image-{}",
        NEXT.fetch_add(1, Ordering::Relaxed)
    ))?;
    // SAFETY: the property list id is ours until `fapl` is dropped (after the open);
    // `bytes` outlives the call and libhdf5 copies the image (no callbacks set)
    // before `H5Fopen` returns, so the `*mut` it takes is never written through.
    let id = unsafe {
        let fapl = H5Pcreate(*H5P_CLS_FILE_ACCESS);
        if fapl < 0 {
            return Err(lib_err("file access list"));
        }
        let fapl = hdf5::from_id::<hdf5::PropertyList>(fapl)
            .map_err(|e| H5Error::Library(format!("file access list: {e}")))?;
        check(H5Pset_fapl_core(fapl.id(), 1 << 16, 0), "core driver")?;
        check(
            H5Pset_file_image(fapl.id(), bytes.as_ptr() as *mut c_void, bytes.len()),
            "file image",
        )?;
        H5Fopen(name.as_ptr(), H5F_ACC_RDONLY, fapl.id())
    };
    if id < 0 {
        return Err(lib_err("open file image"));
    }
    // SAFETY: `id` is the file libhdf5 just opened for us; the `File` takes over its
    // one reference.
    unsafe { hdf5::from_id(id) }.map_err(|e| H5Error::Library(format!("open file image: {e}")))
}

/// Read a fixed-length string attribute of `size` bytes (its type `t`) as bytes,
/// unconverted. The safe read needs a Rust type per width (`FixedAscii<N>`), and
/// this width is only known at run time.
pub fn read_fixed_str(a: &Attribute, t: &Datatype, size: usize) -> Result<Vec<u8>> {
    let mut buf = vec![0u8; size];
    // SAFETY: `buf` holds the one element of the attribute's own type (`size`
    // bytes, its type's size; the caller checked the attribute holds one element);
    // the ids are held by `a` and `t`; the lock is held by the caller.
    check(
        unsafe { H5Aread(a.id(), t.id(), buf.as_mut_ptr().cast()) },
        "read attribute",
    )?;
    Ok(buf)
}

/// Read a whole dataset, converted by libhdf5 into `mem` (exactly `len` bytes).
/// `mem` may be a type the safe API cannot describe (a bfloat16), so the read
/// cannot go through its typed `read_raw`.
pub fn read_dataset(d: &Dataset, mem: &Datatype, len: usize) -> Result<Vec<u8>> {
    let mut buf = vec![0u8; len];
    if len > 0 {
        // SAFETY: the buffer holds every element in the memory type (the caller
        // checked that the shape times its size is `len`); the ids are held by `d`
        // and `mem`; the lock is held by the caller.
        check(
            unsafe {
                H5Dread(
                    d.id(),
                    mem.id(),
                    H5S_ALL,
                    H5S_ALL,
                    H5P_DEFAULT,
                    buf.as_mut_ptr().cast(),
                )
            },
            "read dataset",
        )?;
    }
    Ok(buf)
}

#[cfg(test)]
mod tests {
    use ckpt_core::DType;

    use super::super::dtypes::{storage, BFLOAT};
    use super::*;

    #[test]
    fn made_types_describe_as_themselves() {
        locked(|| {
            let bf16 = TypeDesc::Float {
                bits: BFLOAT,
                little_endian: true,
            };
            for t in DType::ALL.iter().map(|&d| storage(d).0).chain([bf16]) {
                let made = make_type(&t).unwrap();
                assert_eq!(describe(&made).unwrap(), t);
            }
        });
    }

    #[test]
    fn types_that_cannot_be_made_are_refused() {
        let wide_enum = TypeDesc::Enum {
            base: Box::new(TypeDesc::Int {
                size: 2,
                signed: true,
                little_endian: true,
            }),
            members: vec![("A".into(), 0)],
        };
        let big_endian = TypeDesc::Int {
            size: 4,
            signed: true,
            little_endian: false,
        };
        locked(|| {
            for t in [wide_enum, big_endian, TypeDesc::Other("string".into())] {
                assert!(
                    matches!(make_type(&t), Err(H5Error::Unsupported(_))),
                    "{t:?}"
                );
            }
        });
    }

    #[test]
    fn an_image_that_is_not_hdf5_is_a_library_error() {
        assert!(matches!(
            locked(|| open_image(b"not an hdf5 file")),
            Err(H5Error::Library(_))
        ));
    }
}
