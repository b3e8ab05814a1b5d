//! Pure safetensors encoding and decoding over bytes, through the `safetensors` crate.
//!
//! A file is `u64 LE header length | JSON header (space-padded to 8 bytes) | data`.
//! The header maps each tensor name to dtype, shape and `data_offsets` (relative to
//! the data section); `__metadata__` is a string-to-string map where ckpt keeps the
//! non-tensor state as JSON under [`META_KEY`]. Parsing is the `safetensors` crate's
//! (size-capped at 100 MB of header, checked arithmetic, offsets validated).

use std::collections::HashMap;

use bytes::Bytes;
use ckpt_core::{DType, State, Tensor, Value};
use safetensors::tensor::{Metadata, TensorInfo};
use safetensors::{Dtype, SafeTensors};

use crate::error::CodecError;

/// Largest header this codec writes (the `safetensors` reader's own cap).
pub const MAX_HEADER_BYTES: usize = 100_000_000;
/// `__metadata__` key holding the non-tensor state ([`Value`] as JSON).
pub const META_KEY: &str = "ckpt.meta";

/// A tensor to place in a header: name, dtype, shape and byte length.
#[derive(Debug, Clone, Copy)]
pub struct Entry<'a> {
    /// Tensor name.
    pub name: &'a str,
    /// Element type.
    pub dtype: DType,
    /// Shape.
    pub shape: &'a [u64],
    /// Length in bytes.
    pub len: u64,
}

impl<'a> From<&'a Tensor> for Entry<'a> {
    fn from(t: &'a Tensor) -> Self {
        Entry {
            name: &t.name,
            dtype: t.dtype,
            shape: &t.shape,
            len: t.data.len() as u64,
        }
    }
}

/// An encoded header and where each tensor's bytes go in the file.
#[derive(Debug, Clone)]
pub struct Header {
    /// Length prefix, JSON and padding: the first bytes of the file.
    pub bytes: Vec<u8>,
    /// Absolute file offset of each tensor, in input order.
    pub offsets: Vec<u64>,
}

/// The safetensors dtype of a ckpt dtype (the names are the same).
pub fn to_st_dtype(d: DType) -> Result<Dtype, CodecError> {
    serde_json::from_value(serde_json::Value::String(d.name().to_owned()))
        .map_err(|_| CodecError::Malformed(format!("dtype {d} has no safetensors equivalent")))
}

/// The ckpt dtype of a safetensors dtype.
pub fn from_st_dtype(d: Dtype) -> Result<DType, CodecError> {
    let name = serde_json::to_value(d).map_err(|e| CodecError::Malformed(e.to_string()))?;
    name.as_str()
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| CodecError::Malformed(format!("unsupported safetensors dtype {d:?}")))
}

/// Encode a header for tensors laid out back to back in input order.
pub fn encode_header(
    entries: &[Entry<'_>],
    metadata: Option<HashMap<String, String>>,
) -> Result<Header, CodecError> {
    let mut infos = Vec::with_capacity(entries.len());
    let mut seen = std::collections::HashSet::with_capacity(entries.len());
    let mut rel = Vec::with_capacity(entries.len());
    let mut offset: usize = 0;
    for e in entries {
        if e.name == "__metadata__" || !seen.insert(e.name) {
            return Err(CodecError::Malformed(format!(
                "tensor name `{}` is reserved or repeated",
                e.name
            )));
        }
        let len = usize::try_from(e.len)
            .map_err(|_| CodecError::TooLarge(format!("tensor `{}`", e.name)))?;
        let end = offset
            .checked_add(len)
            .ok_or_else(|| CodecError::TooLarge("tensor data overflows".into()))?;
        let shape = e
            .shape
            .iter()
            .map(|&d| {
                usize::try_from(d)
                    .map_err(|_| CodecError::TooLarge(format!("shape of `{}`", e.name)))
            })
            .collect::<Result<Vec<_>, _>>()?;
        infos.push((
            e.name.to_owned(),
            TensorInfo {
                dtype: to_st_dtype(e.dtype)?,
                shape,
                data_offsets: (offset, end),
            },
        ));
        rel.push(offset as u64);
        offset = end;
    }
    let meta = Metadata::new(metadata, infos)
        .map_err(|e| CodecError::Malformed(format!("safetensors: {e}")))?;
    let mut json = serde_json::to_vec(&meta).map_err(|e| CodecError::Malformed(e.to_string()))?;
    let padded = json.len().next_multiple_of(8);
    if padded > MAX_HEADER_BYTES {
        return Err(CodecError::TooLarge(format!(
            "safetensors header of {padded} bytes"
        )));
    }
    json.resize(padded, b' ');
    let mut bytes = Vec::with_capacity(8 + padded);
    bytes.extend_from_slice(&(padded as u64).to_le_bytes());
    bytes.extend_from_slice(&json);
    let base = bytes.len() as u64;
    let offsets = rel.into_iter().map(|o| base + o).collect();
    Ok(Header { bytes, offsets })
}

/// The `__metadata__` ckpt writes: `format: pt` (what the Hugging Face loaders look
/// for) and the non-tensor state, when there is any.
pub fn file_metadata(meta: &Value) -> Result<HashMap<String, String>, CodecError> {
    let mut m = HashMap::from([("format".to_owned(), "pt".to_owned())]);
    if *meta != Value::Null {
        let json = serde_json::to_string(meta).map_err(|e| CodecError::Malformed(e.to_string()))?;
        m.insert(META_KEY.to_owned(), json);
    }
    Ok(m)
}

/// Encode a whole state as one safetensors file.
pub fn encode(state: &State) -> Result<Vec<u8>, CodecError> {
    let entries: Vec<Entry<'_>> = state.tensors.iter().map(Entry::from).collect();
    let header = encode_header(&entries, Some(file_metadata(&state.meta)?))?;
    let mut out = header.bytes;
    out.reserve(state.nbytes() as usize);
    for t in &state.tensors {
        out.extend_from_slice(&t.data);
    }
    Ok(out)
}

/// Decode a safetensors file, written by ckpt or anything else, into a [`State`].
///
/// Tensors come back in file order as zero-copy slices of `bytes`; the metadata is
/// the state ckpt stored under [`META_KEY`], or [`Value::Null`].
pub fn read_file(bytes: &Bytes) -> Result<State, CodecError> {
    let st = SafeTensors::deserialize(bytes)
        .map_err(|e| CodecError::Malformed(format!("safetensors: {e}")))?;
    let (_, metadata) = SafeTensors::read_metadata(bytes)
        .map_err(|e| CodecError::Malformed(format!("safetensors: {e}")))?;
    let mut tensors = Vec::with_capacity(st.len());
    for name in metadata.offset_keys() {
        let view = st
            .tensor(&name)
            .map_err(|e| CodecError::Malformed(format!("safetensors: {e}")))?;
        let dtype = from_st_dtype(view.dtype())?;
        let shape = view.shape().iter().map(|&d| d as u64).collect();
        let t = Tensor::new(name, dtype, shape, bytes.slice_ref(view.data()))
            .map_err(|e| CodecError::Malformed(e.to_string()))?;
        tensors.push(t);
    }
    let meta = match metadata.metadata().as_ref().and_then(|m| m.get(META_KEY)) {
        Some(json) => serde_json::from_str(json)
            .map_err(|e| CodecError::Malformed(format!("{META_KEY}: {e}")))?,
        None => Value::Null,
    };
    Ok(State { tensors, meta })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn sample() -> State {
        State::new()
            .with_tensor(Tensor::from_f32("b.w", vec![2, 2], &[1.0, -2.0, 3.5, f32::NAN]).unwrap())
            .with_tensor(Tensor::new("a", DType::BF16, vec![], vec![1u8, 2]).unwrap())
            .with_tensor(Tensor::new("empty", DType::I64, vec![0, 3], Vec::new()).unwrap())
            .with_tensor(Tensor::new("f4", DType::F4, vec![4], vec![0x12u8, 0x34]).unwrap())
            .with_meta(Value::map([("step", Value::Int(7))]))
    }

    #[test]
    fn round_trip_keeps_order_dtypes_and_meta() {
        let s = sample();
        let bytes = Bytes::from(encode(&s).unwrap());
        assert_eq!(read_file(&bytes).unwrap(), s);
    }

    #[test]
    fn every_dtype_maps_both_ways() {
        for d in DType::ALL {
            assert_eq!(from_st_dtype(to_st_dtype(d).unwrap()).unwrap(), d);
        }
    }

    #[test]
    fn rejects_duplicates_reserved_names_and_truncation() {
        let t = Entry {
            name: "x",
            dtype: DType::U8,
            shape: &[1],
            len: 1,
        };
        assert!(encode_header(&[t, t], None).is_err());
        assert!(encode_header(
            &[Entry {
                name: "__metadata__",
                ..t
            }],
            None
        )
        .is_err());
        let bytes = encode(&sample()).unwrap();
        for cut in [0, 7, 9, bytes.len() - 1] {
            assert!(
                read_file(&Bytes::copy_from_slice(&bytes[..cut])).is_err(),
                "cut {cut}"
            );
        }
    }

    proptest! {
        #[test]
        fn mutated_files_never_panic(pos in any::<prop::sample::Index>(), byte in any::<u8>()) {
            let mut bytes = encode(&sample()).unwrap();
            let i = pos.index(bytes.len());
            bytes[i] = byte;
            let _ = read_file(&Bytes::from(bytes));
        }
    }
}
