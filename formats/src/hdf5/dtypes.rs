//! ckpt dtypes and HDF5 datatypes, both ways. Pure (no libhdf5): [`TypeDesc`]
//! describes an HDF5 datatype; [`super::ffi`] turns it into a libhdf5 type and
//! back.
//!
//! | ckpt | stored as (h5py/numpy sees) | `ckpt_dtype` |
//! | --- | --- | --- |
//! | `BOOL` | enum of int8 `{FALSE: 0, TRUE: 1}` (`bool`) | `BOOL` |
//! | `U8` ... `I64`, `U64` | little-endian integers | same |
//! | `F16`, `F32`, `F64` | IEEE little-endian floats | same |
//! | `C64` | compound `{r: f32, i: f32}` (`complex64`) | `C64` |
//! | `BF16` | `uint16` | `BF16` |
//! | `F8_*` | `uint8` | e.g. `F8_E4M3` |
//! | `F4`, `F6_*` | 1-d `uint8` of the packed bytes, shape in `ckpt_shape` | e.g. `F4` |

use ckpt_core::DType;

use super::error::H5Error;

/// The bit layout of a floating-point type (`H5Tget_fields`, `H5Tget_ebias`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FloatBits {
    /// Size in bytes.
    pub size: usize,
    /// Sign bit position.
    pub spos: usize,
    /// Exponent position and width.
    pub epos: usize,
    /// Exponent width.
    pub esize: usize,
    /// Mantissa position.
    pub mpos: usize,
    /// Mantissa width.
    pub msize: usize,
    /// Exponent bias.
    pub ebias: u64,
}

/// IEEE binary16.
pub const HALF: FloatBits = FloatBits {
    size: 2,
    spos: 15,
    epos: 10,
    esize: 5,
    mpos: 0,
    msize: 10,
    ebias: 15,
};
/// bfloat16 (as a few non-Python tools store it natively).
pub const BFLOAT: FloatBits = FloatBits {
    size: 2,
    spos: 15,
    epos: 7,
    esize: 8,
    mpos: 0,
    msize: 7,
    ebias: 127,
};
/// IEEE binary32.
pub const SINGLE: FloatBits = FloatBits {
    size: 4,
    spos: 31,
    epos: 23,
    esize: 8,
    mpos: 0,
    msize: 23,
    ebias: 127,
};
/// IEEE binary64.
pub const DOUBLE: FloatBits = FloatBits {
    size: 8,
    spos: 63,
    epos: 52,
    esize: 11,
    mpos: 0,
    msize: 52,
    ebias: 1023,
};

/// An HDF5 datatype, as far as ckpt cares.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TypeDesc {
    /// Integer of `size` bytes (1, 2, 4, 8) with no padding bits.
    Int {
        /// Bytes.
        size: usize,
        /// Signed.
        signed: bool,
        /// Byte order.
        little_endian: bool,
    },
    /// Floating point with an implied leading mantissa bit and no padding bits.
    Float {
        /// Layout.
        bits: FloatBits,
        /// Byte order.
        little_endian: bool,
    },
    /// Enumeration over an integer base.
    Enum {
        /// The base type.
        base: Box<TypeDesc>,
        /// Member names and values.
        members: Vec<(String, i64)>,
    },
    /// Compound of named members at byte offsets.
    Compound {
        /// Size in bytes.
        size: usize,
        /// Name, offset, type.
        members: Vec<(String, usize, TypeDesc)>,
    },
    /// Anything else (strings, references, variable-length, arrays, opaque,
    /// bitfields, odd floats or integers): named for the error message.
    Other(String),
}

impl TypeDesc {
    /// Size in bytes of one element, for the kinds ckpt reads.
    pub fn size(&self) -> Option<usize> {
        match self {
            TypeDesc::Int { size, .. } | TypeDesc::Compound { size, .. } => Some(*size),
            TypeDesc::Float { bits, .. } => Some(bits.size),
            TypeDesc::Enum { base, .. } => base.size(),
            TypeDesc::Other(_) => None,
        }
    }
}

const fn int(size: usize, signed: bool) -> TypeDesc {
    TypeDesc::Int {
        size,
        signed,
        little_endian: true,
    }
}

const fn float(bits: FloatBits) -> TypeDesc {
    TypeDesc::Float {
        bits,
        little_endian: true,
    }
}

/// h5py's bool.
pub fn bool_type() -> TypeDesc {
    TypeDesc::Enum {
        base: Box::new(int(1, true)),
        members: vec![("FALSE".into(), 0), ("TRUE".into(), 1)],
    }
}

/// h5py's complex64.
pub fn complex64_type() -> TypeDesc {
    TypeDesc::Compound {
        size: 8,
        members: vec![
            ("r".into(), 0, float(SINGLE)),
            ("i".into(), 4, float(SINGLE)),
        ],
    }
}

/// How a ckpt dtype is stored: the HDF5 type, and whether the bytes are packed
/// (sub-byte dtypes: a 1-d `uint8` dataset with the shape in `ckpt_shape`).
pub fn storage(d: DType) -> (TypeDesc, bool) {
    match d {
        DType::BOOL => (bool_type(), false),
        DType::U8 => (int(1, false), false),
        DType::I8 => (int(1, true), false),
        DType::U16 | DType::BF16 => (int(2, false), false),
        DType::I16 => (int(2, true), false),
        DType::U32 => (int(4, false), false),
        DType::I32 => (int(4, true), false),
        DType::U64 => (int(8, false), false),
        DType::I64 => (int(8, true), false),
        DType::F16 => (float(HALF), false),
        DType::F32 => (float(SINGLE), false),
        DType::F64 => (float(DOUBLE), false),
        DType::C64 => (complex64_type(), false),
        DType::F4 | DType::F6_E2M3 | DType::F6_E3M2 => (int(1, false), true),
        // F8_* and any 8-bit dtype added later.
        _ => (int(1, false), false),
    }
}

/// The dtype an HDF5 type holds natively (what h5py would give numpy), before
/// any `ckpt_dtype` attribute.
pub fn classify(t: &TypeDesc) -> Result<DType, H5Error> {
    Ok(match t {
        TypeDesc::Int { size, signed, .. } => match (size, signed) {
            (1, false) => DType::U8,
            (1, true) => DType::I8,
            (2, false) => DType::U16,
            (2, true) => DType::I16,
            (4, false) => DType::U32,
            (4, true) => DType::I32,
            (8, false) => DType::U64,
            (8, true) => DType::I64,
            _ => return Err(unsupported(t)),
        },
        TypeDesc::Float { bits, .. } => match *bits {
            HALF => DType::F16,
            BFLOAT => DType::BF16,
            SINGLE => DType::F32,
            DOUBLE => DType::F64,
            _ => return Err(unsupported(t)),
        },
        TypeDesc::Enum { base, members } => {
            let is_bool = matches!(**base, TypeDesc::Int { size: 1, .. })
                && members.len() == 2
                && members.iter().any(|(n, v)| n == "FALSE" && *v == 0)
                && members.iter().any(|(n, v)| n == "TRUE" && *v == 1);
            if !is_bool {
                return Err(unsupported(t));
            }
            DType::BOOL
        }
        TypeDesc::Compound { size: 8, members } => {
            let single = |m: &(String, usize, TypeDesc), name: &str, off: usize| {
                m.0 == name && m.1 == off && matches!(m.2, TypeDesc::Float { bits: SINGLE, .. })
            };
            if members.len() == 2 && single(&members[0], "r", 0) && single(&members[1], "i", 4) {
                DType::C64
            } else {
                return Err(unsupported(t));
            }
        }
        _ => return Err(unsupported(t)),
    })
}

fn unsupported(t: &TypeDesc) -> H5Error {
    H5Error::Unsupported(format!("HDF5 datatype {t:?} has no ckpt dtype"))
}

/// The tensor's dtype and shape, given the dtype its HDF5 type holds (`native`),
/// its dataset shape, and its `ckpt_dtype` and `ckpt_shape` attributes. Checked:
/// the attribute must name a dtype stored that way, and the shapes must agree.
pub fn resolve(
    native: DType,
    shape: &[u64],
    ckpt_dtype: Option<&str>,
    ckpt_shape: Option<&[u64]>,
) -> Result<(DType, Vec<u64>), H5Error> {
    let Some(name) = ckpt_dtype else {
        if ckpt_shape.is_some() {
            return Err(H5Error::Malformed(
                "`ckpt_shape` without `ckpt_dtype`".into(),
            ));
        }
        return Ok((native, shape.to_vec()));
    };
    let d: DType = name
        .parse()
        .map_err(|_| H5Error::Malformed(format!("unknown ckpt_dtype `{name}`")))?;
    let (stored, packed) = storage(d);
    let stored_native = classify(&stored)?;
    // A bf16 stored natively (as a float of that layout) may carry the attribute too.
    if stored_native != native && d != native {
        return Err(H5Error::Malformed(format!(
            "ckpt_dtype `{name}` cannot be stored as {native}"
        )));
    }
    if !packed {
        if ckpt_shape.is_some() {
            return Err(H5Error::Malformed(format!("`ckpt_shape` on a {d} dataset")));
        }
        return Ok((d, shape.to_vec()));
    }
    let logical = ckpt_shape
        .ok_or_else(|| H5Error::Malformed(format!("{d} dataset without `ckpt_shape`")))?;
    let numel = logical
        .iter()
        .try_fold(1u64, |a, &x| a.checked_mul(x))
        .ok_or_else(|| H5Error::TooLarge(format!("ckpt_shape {logical:?} overflows")))?;
    let bytes = d
        .byte_len(numel)
        .map_err(|e| H5Error::Malformed(format!("ckpt_shape {logical:?}: {e}")))?;
    if shape != [bytes] {
        return Err(H5Error::Malformed(format!(
            "{d} of shape {logical:?} needs {bytes} bytes, the dataset has shape {shape:?}"
        )));
    }
    Ok((d, logical.to_vec()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_dtype_stored_classifies_and_resolves_back() {
        for d in DType::ALL {
            let (t, packed) = storage(d);
            let native = classify(&t).unwrap();
            let (shape, stored_shape): (Vec<u64>, Vec<u64>) = if packed {
                (vec![4, 6], vec![d.byte_len(24).unwrap()])
            } else {
                (vec![4, 6], vec![4, 6])
            };
            let ckpt_shape = packed.then_some(shape.as_slice());
            let got = resolve(native, &stored_shape, Some(d.name()), ckpt_shape).unwrap();
            assert_eq!(got, (d, shape), "{d}");
        }
    }

    #[test]
    fn mismatched_attributes_are_refused() {
        assert!(matches!(
            resolve(DType::F32, &[2], Some("BF16"), None),
            Err(H5Error::Malformed(_))
        ));
        assert!(matches!(
            resolve(DType::U8, &[2], Some("nope"), None),
            Err(H5Error::Malformed(_))
        ));
        assert!(matches!(
            resolve(DType::U8, &[2], Some("F4"), None),
            Err(H5Error::Malformed(_))
        ));
        assert!(matches!(
            resolve(DType::U8, &[3], Some("F4"), Some(&[4])),
            Err(H5Error::Malformed(_))
        ));
        assert!(matches!(
            resolve(DType::U8, &[1], Some("F4"), Some(&[u64::MAX, 3])),
            Err(H5Error::TooLarge(_))
        ));
        assert!(matches!(
            resolve(DType::U8, &[2], None, Some(&[2])),
            Err(H5Error::Malformed(_))
        ));
        assert_eq!(
            resolve(DType::BF16, &[2], Some("BF16"), None).unwrap(),
            (DType::BF16, vec![2])
        );
    }

    #[test]
    fn odd_types_are_refused() {
        assert!(classify(&TypeDesc::Other("string".into())).is_err());
        assert!(classify(&int(3, true)).is_err());
        let e = TypeDesc::Enum {
            base: Box::new(int(1, true)),
            members: vec![("A".into(), 0)],
        };
        assert!(classify(&e).is_err());
        let c128 = TypeDesc::Compound {
            size: 16,
            members: vec![
                ("r".into(), 0, float(DOUBLE)),
                ("i".into(), 8, float(DOUBLE)),
            ],
        };
        assert!(classify(&c128).is_err());
    }
}
