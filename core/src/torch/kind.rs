//! The mapping between tch's [`Kind`] and ckpt's [`DType`].

use tch::Kind;

use crate::error::{Error, Result};
use crate::model::dtype::DType;

/// The ckpt dtype of a tch kind, or [`Error::Unsupported`] for kinds with no
/// safetensors equivalent (quantized kinds, complex half and complex double).
pub fn dtype_of(kind: Kind) -> Result<DType> {
    Ok(match kind {
        Kind::Uint8 => DType::U8,
        Kind::Int8 => DType::I8,
        Kind::Int16 => DType::I16,
        Kind::Int => DType::I32,
        Kind::Int64 => DType::I64,
        Kind::Half => DType::F16,
        Kind::Float => DType::F32,
        Kind::Double => DType::F64,
        Kind::ComplexFloat => DType::C64,
        Kind::Bool => DType::BOOL,
        Kind::BFloat16 => DType::BF16,
        Kind::Float8e5m2 => DType::F8_E5M2,
        Kind::Float8e4m3fn => DType::F8_E4M3,
        Kind::Float8e5m2fnuz => DType::F8_E5M2FNUZ,
        Kind::Float8e4m3fnuz => DType::F8_E4M3FNUZ,
        Kind::ComplexHalf | Kind::ComplexDouble | Kind::QInt8 | Kind::QUInt8 | Kind::QInt32 => {
            return Err(Error::Unsupported(format!(
                "tch kind {kind:?} has no checkpoint dtype"
            )))
        }
    })
}

/// The tch kind of a ckpt dtype, or [`Error::Unsupported`] for dtypes tch 0.26
/// cannot hold (unsigned 16/32/64-bit, sub-byte floats, e8m0).
pub fn kind_of(dtype: DType) -> Result<Kind> {
    Ok(match dtype {
        DType::U8 => Kind::Uint8,
        DType::I8 => Kind::Int8,
        DType::I16 => Kind::Int16,
        DType::I32 => Kind::Int,
        DType::I64 => Kind::Int64,
        DType::F16 => Kind::Half,
        DType::F32 => Kind::Float,
        DType::F64 => Kind::Double,
        DType::C64 => Kind::ComplexFloat,
        DType::BOOL => Kind::Bool,
        DType::BF16 => Kind::BFloat16,
        DType::F8_E5M2 => Kind::Float8e5m2,
        DType::F8_E4M3 => Kind::Float8e4m3fn,
        DType::F8_E5M2FNUZ => Kind::Float8e5m2fnuz,
        DType::F8_E4M3FNUZ => Kind::Float8e4m3fnuz,
        other => return Err(Error::Unsupported(format!("dtype {other} has no tch kind"))),
    })
}

/// Shape of a tch tensor as ckpt stores it.
pub(crate) fn shape_of(t: &tch::Tensor) -> Result<Vec<u64>> {
    if !t.defined() {
        return Err(Error::InvalidInput("undefined tensor".into()));
    }
    Ok(t.size().into_iter().map(|d| d as u64).collect())
}

/// Shape as tch takes it, refusing dimensions that do not fit an `i64`.
pub(crate) fn shape_i64(shape: &[u64]) -> Result<Vec<i64>> {
    shape
        .iter()
        .map(|&d| {
            i64::try_from(d)
                .map_err(|_| Error::InvalidInput(format!("dimension {d} does not fit libtorch")))
        })
        .collect()
}
