//! ckpt dtypes and their torch names.
//!
//! Dtypes with a legacy typed storage (`torch.FloatStorage`, ...) are written the
//! way `torch.save` writes them (`_rebuild_tensor_v2`); newer dtypes (fp8, unsigned
//! 16/32/64-bit) as an `UntypedStorage` plus a dtype (`_rebuild_tensor_v3`), also as
//! torch does. `F4` and the 6-bit floats have no torch dtype with the same shape
//! meaning and are refused.

use ckpt_core::DType;

/// `(dtype, legacy storage class name)`.
const LEGACY: [(DType, &str); 11] = [
    (DType::F64, "DoubleStorage"),
    (DType::F32, "FloatStorage"),
    (DType::F16, "HalfStorage"),
    (DType::BF16, "BFloat16Storage"),
    (DType::I64, "LongStorage"),
    (DType::I32, "IntStorage"),
    (DType::I16, "ShortStorage"),
    (DType::I8, "CharStorage"),
    (DType::U8, "ByteStorage"),
    (DType::BOOL, "BoolStorage"),
    (DType::C64, "ComplexFloatStorage"),
];

/// `(dtype, torch dtype attribute name)`.
const NAMES: [(DType, &str); 19] = [
    (DType::F64, "float64"),
    (DType::F32, "float32"),
    (DType::F16, "float16"),
    (DType::BF16, "bfloat16"),
    (DType::I64, "int64"),
    (DType::I32, "int32"),
    (DType::I16, "int16"),
    (DType::I8, "int8"),
    (DType::U8, "uint8"),
    (DType::BOOL, "bool"),
    (DType::C64, "complex64"),
    (DType::U16, "uint16"),
    (DType::U32, "uint32"),
    (DType::U64, "uint64"),
    (DType::F8_E5M2, "float8_e5m2"),
    (DType::F8_E4M3, "float8_e4m3fn"),
    (DType::F8_E5M2FNUZ, "float8_e5m2fnuz"),
    (DType::F8_E4M3FNUZ, "float8_e4m3fnuz"),
    (DType::F8_E8M0, "float8_e8m0fnu"),
];

/// The legacy storage class of a dtype, if it has one.
pub fn storage_name(d: DType) -> Option<&'static str> {
    LEGACY.iter().find(|(x, _)| *x == d).map(|(_, n)| *n)
}

/// The dtype of a legacy storage class name.
pub fn from_storage_name(n: &str) -> Option<DType> {
    LEGACY.iter().find(|(_, x)| *x == n).map(|(d, _)| *d)
}

/// The torch attribute name of a dtype (`float8_e4m3fn`), if torch has it.
pub fn torch_name(d: DType) -> Option<&'static str> {
    NAMES.iter().find(|(x, _)| *x == d).map(|(_, n)| *n)
}

/// The dtype of a torch attribute name.
pub fn from_torch_name(n: &str) -> Option<DType> {
    NAMES.iter().find(|(_, x)| *x == n).map(|(d, _)| *d)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_consistent() {
        for d in DType::ALL {
            if let Some(n) = storage_name(d) {
                assert_eq!(from_storage_name(n), Some(d));
                assert!(torch_name(d).is_some());
            }
            if let Some(n) = torch_name(d) {
                assert_eq!(from_torch_name(n), Some(d));
            }
        }
        assert_eq!(torch_name(DType::F4), None);
    }
}
