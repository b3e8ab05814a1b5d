//! Casting floating-point tensors for an export (`--dtype bf16`).
//!
//! Floats (f64, f32, f16, bf16) are converted through f32 with round-to-nearest-even;
//! NaN stays NaN and overflow becomes infinity. Tensors of other dtypes (integers,
//! bool, fp8) are left as they are.

use bytes::Bytes;
use ckpt_core::{DType, Error, Result, Tensor};

/// The dtypes an export can cast floats to.
pub const TARGETS: [DType; 3] = [DType::BF16, DType::F16, DType::F32];

/// True for the dtypes a cast applies to.
pub fn is_float(d: DType) -> bool {
    matches!(d, DType::F64 | DType::F32 | DType::F16 | DType::BF16)
}

/// The dtype a tensor of dtype `d` has after casting to `target`.
pub fn cast_dtype(d: DType, target: Option<DType>) -> DType {
    match target {
        Some(t) if is_float(d) => t,
        _ => d,
    }
}

/// Parse a `--dtype` argument (`bf16`, `f16`, `f32`, also as `bfloat16`, `float16`, ...).
pub fn parse_target(s: &str) -> Result<DType> {
    let d = match s.to_ascii_lowercase().as_str() {
        "bf16" | "bfloat16" => DType::BF16,
        "f16" | "fp16" | "float16" | "half" => DType::F16,
        "f32" | "fp32" | "float32" | "float" => DType::F32,
        _ => {
            return Err(Error::InvalidInput(format!(
                "dtype `{s}`: an export casts floats to bf16, f16 or f32"
            )))
        }
    };
    Ok(d)
}

/// `t` with its floats cast to `target` (a no-op for other dtypes and same dtype).
pub fn cast(t: Tensor, target: Option<DType>) -> Result<Tensor> {
    let to = cast_dtype(t.dtype, target);
    if to == t.dtype {
        return Ok(t);
    }
    let vals = to_f32(t.dtype, &t.data);
    let mut out = Vec::with_capacity(vals.len() * (to.bits() / 8) as usize);
    for v in vals {
        match to {
            DType::BF16 => out.extend_from_slice(&f32_to_bf16(v).to_le_bytes()),
            DType::F16 => out.extend_from_slice(&f32_to_f16(v).to_le_bytes()),
            _ => out.extend_from_slice(&v.to_le_bytes()),
        }
    }
    Tensor::new(t.name, to, t.shape, Bytes::from(out))
}

fn to_f32(d: DType, data: &[u8]) -> Vec<f32> {
    match d {
        DType::F64 => data
            .chunks_exact(8)
            .map(|c| f64::from_le_bytes(c.try_into().unwrap()) as f32)
            .collect(),
        DType::F16 => data
            .chunks_exact(2)
            .map(|c| f16_to_f32(u16::from_le_bytes([c[0], c[1]])))
            .collect(),
        DType::BF16 => data
            .chunks_exact(2)
            .map(|c| f32::from_bits((u16::from_le_bytes([c[0], c[1]]) as u32) << 16))
            .collect(),
        _ => data
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect(),
    }
}

/// f32 to bfloat16 bits, round to nearest even.
pub fn f32_to_bf16(x: f32) -> u16 {
    let b = x.to_bits();
    if x.is_nan() {
        return ((b >> 16) | 0x40) as u16;
    }
    ((b + 0x7fff + ((b >> 16) & 1)) >> 16) as u16
}

/// f32 to IEEE half bits, round to nearest even.
pub fn f32_to_f16(x: f32) -> u16 {
    let b = x.to_bits();
    let sign = ((b >> 16) & 0x8000) as u16;
    let exp = ((b >> 23) & 0xff) as i32;
    let man = b & 0x7f_ffff;
    if exp == 0xff {
        return sign
            | 0x7c00
            | if man != 0 {
                0x200 | (man >> 13) as u16
            } else {
                0
            };
    }
    let e = exp - 127 + 15;
    if e >= 0x1f {
        return sign | 0x7c00;
    }
    let (r, rem, half) = if e <= 0 {
        if e < -10 {
            return sign;
        }
        // Subnormal: the value in units of 2^-24 is the 24-bit mantissa >> (14 - e).
        let m = man | 0x80_0000;
        let shift = (14 - e) as u32;
        (m >> shift, m & ((1 << shift) - 1), 1u32 << (shift - 1))
    } else {
        (((e as u32) << 10) | (man >> 13), man & 0x1fff, 0x1000)
    };
    // A carry out of the mantissa moves into the exponent, which is the right result.
    let r = if rem > half || (rem == half && r & 1 == 1) {
        r + 1
    } else {
        r
    };
    sign | r as u16
}

/// IEEE half bits to f32 (exact).
pub fn f16_to_f32(h: u16) -> f32 {
    let neg = h & 0x8000 != 0;
    let exp = ((h >> 10) & 0x1f) as u32;
    let man = (h & 0x3ff) as u32;
    let v = match exp {
        0 => man as f32 * (1.0 / 16_777_216.0), // 2^-24
        0x1f => f32::from_bits(0x7f80_0000 | (man << 13)),
        _ => f32::from_bits(((exp + 112) << 23) | (man << 13)),
    };
    if neg {
        -v
    } else {
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn half_round_trips_every_value_and_rounds_to_even() {
        for h in 0..=u16::MAX {
            let f = f16_to_f32(h);
            if f.is_nan() {
                assert!(f16_to_f32(f32_to_f16(f)).is_nan());
            } else {
                assert_eq!(f32_to_f16(f), h, "{h:#x} -> {f}");
            }
        }
        assert_eq!(f32_to_f16(1.0 + 1.0 / 2048.0), 0x3c00); // tie -> even
        assert_eq!(f32_to_f16(1.0 + 3.0 / 2048.0), 0x3c02); // tie -> even (up)
        assert_eq!(f32_to_f16(65520.0), 0x7c00); // rounds to infinity
        assert_eq!(f32_to_f16(2f32.powi(-25)), 0); // half the smallest subnormal -> 0
        assert_eq!(f32_to_f16(2f32.powi(-25) * 1.5), 1);
    }

    #[test]
    fn bf16_rounds_to_even_and_keeps_nan() {
        assert_eq!(f32_to_bf16(1.0), 0x3f80);
        assert_eq!(f32_to_bf16(f32::from_bits(0x3f80_8000)), 0x3f80); // tie -> even
        assert_eq!(f32_to_bf16(f32::from_bits(0x3f81_8000)), 0x3f82);
        assert_eq!(f32_to_bf16(f32::NAN) & 0x7fc0, 0x7fc0);
    }

    #[test]
    fn casts_floats_only() {
        let t = Tensor::from_f32("w", vec![2], &[1.5, -2.0]).unwrap();
        let c = cast(t, Some(DType::BF16)).unwrap();
        assert_eq!(
            (c.dtype, c.data.as_ref()),
            (DType::BF16, &[0xc0, 0x3f, 0x00, 0xc0][..])
        );
        let i = Tensor::new("i", DType::I64, vec![1], vec![7u8, 0, 0, 0, 0, 0, 0, 0]).unwrap();
        assert_eq!(cast(i.clone(), Some(DType::BF16)).unwrap(), i);
        assert!(parse_target("int8").is_err());
    }
}
