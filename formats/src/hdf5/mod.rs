//! HDF5 files (feature `hdf5`, through libhdf5): one `.h5` file per rank that
//! h5py opens without ckpt.
//!
//! ```text
//! data/<step>-<attempt>/model-rank00000.h5
//! ```
//!
//! - One dataset per tensor, contiguous and uncompressed, dtype and shape kept.
//!   Each entry of the state is a group and its state-dict keys are datasets:
//!   `model.layers.0.weight` is `/model/layers.0.weight`, so `f["model"]` reads
//!   like `model.state_dict()`. A name that cannot be a path (`a` next to `a.b`,
//!   empty parts, a `/`) goes to the group `ckpt.flat` with its exact name in a
//!   `ckpt_name` attribute (see [`names`]). Files from elsewhere with deeper
//!   groups (`/model/layers/0/weight`) read back as dotted names too.
//! - Attributes: the root's `ckpt_meta` is the non-tensor state as JSON (for a
//!   single-process checkpoint and files written by [`encode`]); every dataset has
//!   `ckpt_dtype` (the ckpt dtype name) and `ckpt_index` (its position in the state).
//! - dtypes that numpy lacks are stored as integers of their width: `BF16` as
//!   `uint16`, `F8_*` as `uint8`, `F4`/`F6_*` as a 1-d `uint8` of the packed bytes
//!   with the shape in `ckpt_shape` (the table is in [`dtypes`]). In h5py:
//!
//! ```python
//! a = f["model/w"][()]                                    # uint16, ckpt_dtype "BF16"
//! w = torch.from_numpy(a).view(torch.bfloat16)            # F8_E4M3: torch.float8_e4m3fn
//! ```
//!
//! The file is written for any store: libhdf5 lays it out in a temporary file,
//! then it is uploaded as one object with each tensor's bytes in the range
//! libhdf5 reserved for it ([`write`]). Each tensor is a
//! [`ckpt_core::Layout::Range`] of that object with its blake3, so the engine
//! reads only that range, from any store, and verifies it.
//!
//! [`read_h5`] imports files written by anything (see [`read`] for what it
//! accepts), and [`encode`] writes a whole state as one file, both used by
//! `ckpt convert`.

pub mod dtypes;
pub mod error;
mod ffi;
mod h5;
pub mod names;
pub mod read;
pub mod write;

use std::time::Instant;

use async_trait::async_trait;
use bytes::Bytes;
use ckpt_core::format::io::put_object;
use ckpt_core::{Format, Result, State, Tensor, Value, WriteContext, WriteOutput};

use crate::safetensors::ranged;

pub use error::H5Error;
pub use read::{Limits, Source};

/// Root attribute: the non-tensor state, as JSON.
pub const ATTR_META: &str = "ckpt_meta";
/// Dataset attribute: the ckpt dtype name.
pub const ATTR_DTYPE: &str = "ckpt_dtype";
/// Dataset attribute: position of the tensor in the state.
pub const ATTR_INDEX: &str = "ckpt_index";
/// Dataset attribute: the tensor name, where it is not the dataset's path.
pub const ATTR_NAME: &str = "ckpt_name";
/// Dataset attribute: the shape of a packed sub-byte tensor.
pub const ATTR_SHAPE: &str = "ckpt_shape";

/// The HDF5 format.
#[derive(Debug, Clone, Default)]
pub struct Hdf5;

fn entries(tensors: &[Tensor]) -> Vec<write::Entry> {
    tensors
        .iter()
        .map(|t| write::Entry {
            name: t.name.clone(),
            dtype: t.dtype,
            shape: t.shape.clone(),
            len: t.data.len() as u64,
        })
        .collect()
}

/// Encode a whole state as one HDF5 file (its non-tensor state in `ckpt_meta`).
pub fn encode(state: &State) -> std::result::Result<Vec<u8>, H5Error> {
    let laid = write::lay_out(&entries(&state.tensors), &state.meta)?;
    let datas: Vec<Bytes> = state.tensors.iter().map(|t| t.data.clone()).collect();
    let parts = laid.parts(&datas)?;
    let mut out = Vec::with_capacity(laid.file_len as usize);
    for p in parts {
        out.extend_from_slice(&p);
    }
    Ok(out)
}

/// Read an HDF5 file (a path or its bytes) into a state, with the default [`Limits`].
pub fn read_h5<'a>(src: impl Into<Source<'a>>) -> std::result::Result<State, H5Error> {
    read::read_with(src.into(), &Limits::default())
}

#[async_trait]
impl Format for Hdf5 {
    fn name(&self) -> &'static str {
        "hdf5"
    }

    async fn write(&self, ctx: &WriteContext, tensors: &[Tensor]) -> Result<WriteOutput> {
        let meta = if ctx.world_size == 1 {
            ctx.meta.clone()
        } else {
            Value::Null
        };
        let ents = entries(tensors);
        let datas: Vec<Bytes> = tensors.iter().map(|t| t.data.clone()).collect();
        let lay = ranged::blocking(move || {
            let start = Instant::now();
            let laid = write::lay_out(&ents, &meta)?;
            let parts = laid.parts(&datas)?;
            Ok::<_, H5Error>((laid.offsets, parts, start.elapsed()))
        });
        let (laid, hashes) = futures::try_join!(lay, ranged::hash_tensors(ctx, tensors))?;
        let (offsets, parts, took) = laid?;
        ctx.stats.add_encode_time(took);

        let key = ctx
            .data_prefix
            .clone()
            .join(ranged::rank_file(ctx.rank, "h5").as_str());
        put_object(ctx, &key, parts).await?;
        let records = ranged::range_records(tensors, key.as_ref(), &offsets, hashes);
        Ok(WriteOutput {
            records,
            objects: vec![key.to_string()],
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ckpt_core::{DType, Key};

    #[test]
    fn the_same_state_gives_the_same_bytes() {
        // No creation or modification times in the file: a second save a second
        // later is byte-identical.
        let a = encode(&sample()).unwrap();
        std::thread::sleep(std::time::Duration::from_millis(1100));
        assert!(
            a == encode(&sample()).unwrap(),
            "two encodings of one state differ"
        );
    }

    fn sample() -> State {
        let mut s = State::new();
        for (i, d) in DType::ALL.iter().enumerate() {
            let len = d.byte_len(24).unwrap() as usize;
            let data: Vec<u8> = (0..len)
                .map(|j| (j * 31 + i * 7) as u8 & if *d == DType::BOOL { 1 } else { 0xff })
                .collect();
            s = s.with_tensor(
                Tensor::new(format!("dtypes.{}", d.name()), *d, vec![4, 6], data).unwrap(),
            );
        }
        s.with_tensor(Tensor::new("a.b", DType::F32, vec![1], vec![1u8, 2, 3, 4]).unwrap())
            .with_tensor(Tensor::new("a.b.c", DType::I8, vec![], vec![9u8]).unwrap())
            .with_tensor(Tensor::new("x/y", DType::F64, vec![0, 3], Vec::new()).unwrap())
            .with_tensor(Tensor::new("empty", DType::F4, vec![0], Vec::new()).unwrap())
            .with_meta(Value::map([
                ("step", Value::Int(3)),
                ("big", Value::Str("m".repeat(200_000))),
                (
                    "w",
                    Value::Map(vec![(Key::Int(0), Value::Tensor("a.b".into()))]),
                ),
            ]))
    }

    #[test]
    fn encode_then_read_is_identical_from_bytes_and_from_a_path() {
        let s = sample();
        let bytes = encode(&s).unwrap();
        assert_eq!(read_h5(&bytes).unwrap(), s);
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("s.h5");
        std::fs::write(&p, &bytes).unwrap();
        assert_eq!(read_h5(&p).unwrap(), s);
    }

    #[test]
    fn offsets_point_at_each_tensors_bytes() {
        let s = sample();
        let laid = write::lay_out(&entries(&s.tensors), &Value::Null).unwrap();
        let datas: Vec<Bytes> = s.tensors.iter().map(|t| t.data.clone()).collect();
        let file: Vec<u8> = laid.parts(&datas).unwrap().concat();
        assert_eq!(file.len() as u64, laid.file_len);
        for (t, &off) in s.tensors.iter().zip(&laid.offsets) {
            let off = off as usize;
            assert_eq!(&file[off..off + t.data.len()], &t.data[..], "{}", t.name);
        }
    }

    #[test]
    fn caps_and_garbage_are_typed_errors() {
        let bytes = encode(&sample()).unwrap();
        let tight = Limits {
            max_bytes: 100,
            ..Limits::default()
        };
        assert!(matches!(
            read::read_with(Source::Bytes(&bytes), &tight),
            Err(H5Error::TooLarge(_))
        ));
        let few = Limits {
            max_tensors: 3,
            ..Limits::default()
        };
        assert!(matches!(
            read::read_with(Source::Bytes(&bytes), &few),
            Err(H5Error::TooLarge(_))
        ));
        let shallow = Limits {
            max_depth: 1,
            ..Limits::default()
        };
        assert!(matches!(
            read::read_with(Source::Bytes(&bytes), &shallow),
            Err(H5Error::TooLarge(_))
        ));
        assert!(matches!(
            read_h5(&b"not an hdf5 file"[..]),
            Err(H5Error::Library(_))
        ));
        let mut cut = bytes.clone();
        cut.truncate(cut.len() / 2);
        assert!(read_h5(&cut).is_err());
    }
}
