//! Element types. Every dtype that safetensors knows, sub-byte floats included.

use serde::{Deserialize, Serialize};
use std::fmt;
use std::str::FromStr;

use crate::error::{Error, Result};

/// The element type of a tensor. Names follow safetensors (`F32`, `BF16`, `F8_E4M3`, ...).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[non_exhaustive]
#[allow(non_camel_case_types)] // the safetensors names, as users know them
pub enum DType {
    /// Boolean, one byte per element.
    BOOL,
    /// 4-bit float (e2m1), two elements per byte.
    F4,
    /// 6-bit float (e2m3).
    F6_E2M3,
    /// 6-bit float (e3m2).
    F6_E3M2,
    /// Unsigned 8-bit integer.
    U8,
    /// Signed 8-bit integer.
    I8,
    /// 8-bit float, 5 exponent bits and 2 mantissa bits.
    F8_E5M2,
    /// 8-bit float, 4 exponent bits and 3 mantissa bits.
    F8_E4M3,
    /// 8-bit exponent-only scale format (e8m0).
    F8_E8M0,
    /// 8-bit float e4m3, finite, with NaN as negative zero (AMD layout).
    F8_E4M3FNUZ,
    /// 8-bit float e5m2, finite, with NaN as negative zero (AMD layout).
    F8_E5M2FNUZ,
    /// Signed 16-bit integer.
    I16,
    /// Unsigned 16-bit integer.
    U16,
    /// IEEE half precision.
    F16,
    /// bfloat16.
    BF16,
    /// Signed 32-bit integer.
    I32,
    /// Unsigned 32-bit integer.
    U32,
    /// IEEE single precision.
    F32,
    /// Complex of two f32.
    C64,
    /// IEEE double precision.
    F64,
    /// Signed 64-bit integer.
    I64,
    /// Unsigned 64-bit integer.
    U64,
}

impl DType {
    /// Every dtype, in a stable order.
    pub const ALL: [DType; 22] = [
        DType::BOOL,
        DType::F4,
        DType::F6_E2M3,
        DType::F6_E3M2,
        DType::U8,
        DType::I8,
        DType::F8_E5M2,
        DType::F8_E4M3,
        DType::F8_E8M0,
        DType::F8_E4M3FNUZ,
        DType::F8_E5M2FNUZ,
        DType::I16,
        DType::U16,
        DType::F16,
        DType::BF16,
        DType::I32,
        DType::U32,
        DType::F32,
        DType::C64,
        DType::F64,
        DType::I64,
        DType::U64,
    ];

    /// Size of one element in bits.
    pub const fn bits(self) -> u64 {
        match self {
            DType::F4 => 4,
            DType::F6_E2M3 | DType::F6_E3M2 => 6,
            DType::BOOL
            | DType::U8
            | DType::I8
            | DType::F8_E5M2
            | DType::F8_E4M3
            | DType::F8_E8M0
            | DType::F8_E4M3FNUZ
            | DType::F8_E5M2FNUZ => 8,
            DType::I16 | DType::U16 | DType::F16 | DType::BF16 => 16,
            DType::I32 | DType::U32 | DType::F32 => 32,
            DType::C64 | DType::F64 | DType::I64 | DType::U64 => 64,
        }
    }

    /// The name used in manifests and in safetensors headers.
    pub const fn name(self) -> &'static str {
        match self {
            DType::BOOL => "BOOL",
            DType::F4 => "F4",
            DType::F6_E2M3 => "F6_E2M3",
            DType::F6_E3M2 => "F6_E3M2",
            DType::U8 => "U8",
            DType::I8 => "I8",
            DType::F8_E5M2 => "F8_E5M2",
            DType::F8_E4M3 => "F8_E4M3",
            DType::F8_E8M0 => "F8_E8M0",
            DType::F8_E4M3FNUZ => "F8_E4M3FNUZ",
            DType::F8_E5M2FNUZ => "F8_E5M2FNUZ",
            DType::I16 => "I16",
            DType::U16 => "U16",
            DType::F16 => "F16",
            DType::BF16 => "BF16",
            DType::I32 => "I32",
            DType::U32 => "U32",
            DType::F32 => "F32",
            DType::C64 => "C64",
            DType::F64 => "F64",
            DType::I64 => "I64",
            DType::U64 => "U64",
        }
    }

    /// Number of bytes that `numel` elements occupy, or an error when the count
    /// overflows or does not fill whole bytes (sub-byte dtypes).
    pub fn byte_len(self, numel: u64) -> Result<u64> {
        let bits = numel
            .checked_mul(self.bits())
            .ok_or_else(|| Error::InvalidInput(format!("{numel} elements of {self} overflow")))?;
        if bits % 8 != 0 {
            return Err(Error::InvalidInput(format!(
                "{numel} elements of {self} do not fill whole bytes"
            )));
        }
        Ok(bits / 8)
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for DType {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        DType::ALL
            .iter()
            .copied()
            .find(|d| d.name() == s)
            .ok_or_else(|| Error::Unsupported(format!("unknown dtype `{s}`")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        for d in DType::ALL {
            assert_eq!(d.name().parse::<DType>().unwrap(), d);
            let json = serde_json::to_string(&d).unwrap();
            assert_eq!(json, format!("\"{}\"", d.name()));
        }
        assert!("F128".parse::<DType>().is_err());
    }

    #[test]
    fn byte_len_checks() {
        assert_eq!(DType::F32.byte_len(3).unwrap(), 12);
        assert_eq!(DType::F4.byte_len(4).unwrap(), 2);
        assert!(DType::F4.byte_len(3).is_err());
        assert!(DType::F6_E2M3.byte_len(4).is_ok());
        assert!(DType::U64.byte_len(u64::MAX).is_err());
    }
}
