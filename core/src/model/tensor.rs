//! Tensors: a name, a dtype, a shape and bytes held without copies.

use bytes::Bytes;
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::model::dtype::DType;

/// Where a tensor sits inside a larger global tensor that is split across ranks.
///
/// The tensor's own `shape` is the local extent; `offsets[i] + shape[i] <= global_shape[i]`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShardSpec {
    /// Shape of the whole (global) tensor.
    pub global_shape: Vec<u64>,
    /// Offset of this piece in each dimension of the global tensor.
    pub offsets: Vec<u64>,
}

/// One tensor of a training state: dense, row-major (C order), little-endian.
///
/// The bytes are a [`Bytes`], so cloning a tensor or slicing it into chunks
/// never copies the data.
#[derive(Debug, Clone, PartialEq)]
pub struct Tensor {
    /// Unique name within a state, e.g. `model.layers.0.weight`.
    pub name: String,
    /// Element type.
    pub dtype: DType,
    /// Shape; empty for a 0-d (scalar) tensor.
    pub shape: Vec<u64>,
    /// The raw bytes, `numel * dtype.bits() / 8` of them.
    pub data: Bytes,
    /// Set when this tensor is a piece of a global tensor split across ranks.
    pub shard: Option<ShardSpec>,
}

impl Tensor {
    /// Make a tensor, checking that the byte length matches dtype and shape.
    pub fn new(
        name: impl Into<String>,
        dtype: DType,
        shape: Vec<u64>,
        data: impl Into<Bytes>,
    ) -> Result<Self> {
        let t = Tensor {
            name: name.into(),
            dtype,
            shape,
            data: data.into(),
            shard: None,
        };
        t.validate()?;
        Ok(t)
    }

    /// Mark this tensor as a piece of a global tensor.
    pub fn with_shard(mut self, shard: ShardSpec) -> Result<Self> {
        self.shard = Some(shard);
        self.validate()?;
        Ok(self)
    }

    /// Make an `F32` tensor from values (handy in tests and examples).
    pub fn from_f32(name: impl Into<String>, shape: Vec<u64>, values: &[f32]) -> Result<Self> {
        let mut bytes = Vec::with_capacity(values.len() * 4);
        for v in values {
            bytes.extend_from_slice(&v.to_le_bytes());
        }
        Tensor::new(name, DType::F32, shape, bytes)
    }

    /// Number of elements (1 for a 0-d tensor).
    pub fn numel(&self) -> Result<u64> {
        numel(&self.shape)
    }

    /// Check that the data length, shape and shard placement agree.
    pub fn validate(&self) -> Result<()> {
        check_layout(
            &self.name,
            self.dtype,
            &self.shape,
            self.shard.as_ref(),
            self.data.len(),
        )
    }
}

/// Check that a tensor of this name, dtype, shape and placement can hold `len` bytes.
pub fn check_layout(
    name: &str,
    dtype: DType,
    shape: &[u64],
    shard: Option<&ShardSpec>,
    len: usize,
) -> Result<()> {
    if name.is_empty() {
        return Err(Error::InvalidInput("tensor name is empty".into()));
    }
    let want = dtype.byte_len(numel(shape)?)?;
    if want != len as u64 {
        return Err(Error::InvalidInput(format!(
            "tensor `{name}`: {dtype} {shape:?} needs {want} bytes, got {len}"
        )));
    }
    if let Some(shard) = shard {
        check_shard(name, shape, shard)?;
    }
    Ok(())
}

/// Number of elements of a shape, with overflow checked.
pub fn numel(shape: &[u64]) -> Result<u64> {
    shape.iter().try_fold(1u64, |acc, &d| {
        acc.checked_mul(d)
            .ok_or_else(|| Error::InvalidInput(format!("shape {shape:?} overflows")))
    })
}

fn check_shard(name: &str, shape: &[u64], shard: &ShardSpec) -> Result<()> {
    if shard.global_shape.len() != shape.len() || shard.offsets.len() != shape.len() {
        return Err(Error::InvalidInput(format!(
            "tensor `{name}`: shard rank does not match shape {shape:?}"
        )));
    }
    for ((&off, &len), &global) in shard.offsets.iter().zip(shape).zip(&shard.global_shape) {
        let end = off.checked_add(len).ok_or_else(|| {
            Error::InvalidInput(format!("tensor `{name}`: shard offset overflows"))
        })?;
        if end > global {
            return Err(Error::InvalidInput(format!(
                "tensor `{name}`: shard {:?}+{shape:?} exceeds global shape {:?}",
                shard.offsets, shard.global_shape
            )));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn validates_length() {
        assert!(Tensor::new("a", DType::F32, vec![2, 3], vec![0u8; 24]).is_ok());
        assert!(Tensor::new("a", DType::F32, vec![2, 3], vec![0u8; 23]).is_err());
        assert!(Tensor::new("s", DType::F64, vec![], vec![0u8; 8]).is_ok());
        assert!(Tensor::new("e", DType::F64, vec![0, 5], Vec::new()).is_ok());
        assert!(Tensor::new("", DType::U8, vec![1], vec![0u8]).is_err());
    }

    #[test]
    fn validates_shard() {
        let t = Tensor::new("a", DType::U8, vec![2, 2], vec![0u8; 4]).unwrap();
        let ok = ShardSpec {
            global_shape: vec![4, 2],
            offsets: vec![2, 0],
        };
        assert!(t.clone().with_shard(ok).is_ok());
        let bad = ShardSpec {
            global_shape: vec![4, 2],
            offsets: vec![3, 0],
        };
        assert!(t.with_shard(bad).is_err());
    }
}
