//! torch `.pt` files: the zip-of-pickle layout that `torch.load(weights_only=True)`
//! opens, written and read by our own code.
//!
//! ```text
//! archive/data.pkl               the object tree (restricted pickle, protocol 2)
//! archive/.format_version        "1"
//! archive/.storage_alignment     "64"
//! archive/byteorder              "little"
//! archive/data/<i>               tensor i's bytes, 64-byte aligned
//! archive/version                "3\n"
//! archive/.data/serialization_id
//! ```
//!
//! The engine writes one file per rank (`data/<ckpt>/model-rank00000.pt`) holding a
//! flat `{name: tensor}` dict; each tensor is a [`ckpt_core::Layout::Range`] of the
//! file with its blake3, so loads through the engine verify every tensor.
//! [`write_pt`] and [`read_pt`] convert whole states, nested state dicts (model +
//! optimizer) included; [`read_pt`] opens files written by `torch.save` and refuses
//! any pickle that would call something other than the tensor rebuild functions and
//! plain containers, so loading never runs code from a file.
//!
//! A state saved by the Python package is written as plain state dicts
//! (`torch.load(f)["model"]` goes straight into `model.load_state_dict`), with
//! ckpt's own state under the key `__ckpt__` (see [`crate::pylayout`]); the exact
//! Python types stay in the manifest, which is what ckpt loads from.

pub mod dtypes;
pub mod pickle;
pub mod tree;
pub mod unpickle;
pub mod zip;

use std::collections::HashMap;
use std::time::Instant;

use async_trait::async_trait;
use bytes::Bytes;
use ckpt_core::format::io::put_object;
use ckpt_core::{Format, Key, Result, State, Tensor, Value, WriteContext, WriteOutput};
use futures::{StreamExt, TryStreamExt};

use crate::error::CodecError;
use crate::safetensors::ranged;

/// Largest `.pt` file [`read_pt`] accepts.
pub const MAX_FILE_BYTES: u64 = 1 << 40;
const ARCHIVE: &str = "archive";

/// The torch `.pt` format.
#[derive(Debug, Clone, Default)]
pub struct Torch;

/// A laid-out `.pt` file: the zip plan and each tensor's data offset.
#[derive(Debug, Clone)]
pub struct Archive {
    /// The zip parts and offsets.
    pub plan: zip::Plan,
    /// File offset of each tensor's bytes, in the order of the tensors given.
    pub offsets: Vec<u64>,
}

/// Lay out a `.pt` file holding `root` (whose [`Value::Tensor`] leaves name
/// `tensors`); `crcs[i]` is the CRC-32 of `tensors[i]`.
pub fn archive(root: &Value, tensors: &[Tensor], crcs: &[u32]) -> Result<Archive, CodecError> {
    let slots: HashMap<&str, pickle::Slot<'_>> = tensors
        .iter()
        .enumerate()
        .map(|(i, t)| {
            (
                t.name.as_str(),
                pickle::Slot {
                    key: i.to_string(),
                    tensor: t,
                },
            )
        })
        .collect();
    if slots.len() != tensors.len() {
        return Err(CodecError::Malformed("duplicate tensor names".into()));
    }
    let pkl = pickle::pickle(root, &slots)?;
    let id: String = blake3::hash(&pkl)
        .as_bytes()
        .iter()
        .take(20)
        .map(|b| format!("{:02}", b % 100))
        .collect();
    let small = |name: &str, data: Vec<u8>| zip::Entry {
        name: format!("{ARCHIVE}/{name}"),
        crc: crc32fast::hash(&data),
        data: Bytes::from(data),
    };
    let mut entries = vec![
        small("data.pkl", pkl),
        small(".format_version", b"1".to_vec()),
        small(".storage_alignment", b"64".to_vec()),
        small("byteorder", b"little".to_vec()),
    ];
    let first = entries.len();
    for ((i, t), &crc) in tensors.iter().enumerate().zip(crcs) {
        entries.push(zip::Entry {
            name: format!("{ARCHIVE}/data/{i}"),
            data: t.data.clone(),
            crc,
        });
    }
    entries.push(small("version", b"3\n".to_vec()));
    entries.push(small(".data/serialization_id", id.into_bytes()));
    let plan = zip::plan(&entries)?;
    let offsets = plan.data_offsets[first..first + tensors.len()].to_vec();
    Ok(Archive { plan, offsets })
}

/// The top object of the `.pt` file of a whole state: for the Python package's
/// metadata, plain state dicts with ckpt's internals under one key
/// ([`crate::pylayout::plain_root`]); otherwise [`tree::root_of`].
pub fn root_for(state: &State) -> Value {
    crate::pylayout::plain_root(&state.meta, &state.tensors).unwrap_or_else(|| tree::root_of(state))
}

/// Encode a whole state as one `.pt` file (see [`root_for`] for its top object).
pub fn write_pt(state: &State) -> Result<Vec<u8>, CodecError> {
    let crcs: Vec<u32> = state
        .tensors
        .iter()
        .map(|t| crc32fast::hash(&t.data))
        .collect();
    let a = archive(&root_for(state), &state.tensors, &crcs)?;
    let mut out = Vec::with_capacity(a.plan.len as usize);
    for p in &a.plan.parts {
        out.extend_from_slice(p);
    }
    Ok(out)
}

/// Decode a `.pt` file (ours or `torch.save`'s) into a state, refusing anything
/// that is not tensors and plain data. Every record's CRC-32 is checked.
pub fn read_pt(bytes: &Bytes) -> Result<State, CodecError> {
    if bytes.len() as u64 > MAX_FILE_BYTES {
        return Err(CodecError::TooLarge(format!(
            ".pt file of {} bytes",
            bytes.len()
        )));
    }
    let entries = zip::parse(bytes)?;
    let pkl = entries
        .iter()
        .find(|e| e.name.ends_with("/data.pkl") && e.name.matches('/').count() == 1)
        .ok_or_else(|| CodecError::Malformed("not a torch file: no <archive>/data.pkl".into()))?;
    let prefix = pkl.name.trim_end_matches("data.pkl").to_owned();
    let by_name: HashMap<&str, &zip::Found> =
        entries.iter().map(|e| (e.name.as_str(), e)).collect();
    let record = |name: &str| -> Result<Bytes, CodecError> {
        let e = by_name
            .get(format!("{prefix}{name}").as_str())
            .ok_or_else(|| CodecError::Malformed(format!("record `{name}` is missing")))?;
        let data = bytes.slice(e.offset..e.offset + e.len);
        if crc32fast::hash(&data) != e.crc {
            return Err(CodecError::Malformed(format!(
                "record `{name}`: CRC-32 mismatch"
            )));
        }
        Ok(data)
    };
    if by_name.contains_key(format!("{prefix}byteorder").as_str())
        && record("byteorder")?.as_ref() != b"little"
    {
        return Err(CodecError::Malformed(
            "big-endian .pt files are not supported".into(),
        ));
    }
    let p = unpickle::unpickle(&record("data.pkl")?)?;
    tree::to_state(&p, &|key| record(&format!("data/{key}")))
}

#[async_trait]
impl Format for Torch {
    fn name(&self) -> &'static str {
        "torch"
    }

    async fn write(&self, ctx: &WriteContext, tensors: &[Tensor]) -> Result<WriteOutput> {
        let start = Instant::now();
        let datas: Vec<Bytes> = tensors.iter().map(|t| t.data.clone()).collect();
        let sums: Vec<(String, u32)> = futures::stream::iter(datas)
            .map(|d| {
                ranged::blocking(move || {
                    (blake3::hash(&d).to_hex().to_string(), crc32fast::hash(&d))
                })
            })
            .buffered(ctx.options.concurrency.max(1))
            .try_collect()
            .await?;
        ctx.stats.add_hash_time(start.elapsed());
        ctx.stats
            .add_raw(tensors.iter().map(|t| t.data.len() as u64).sum());
        let (hashes, crcs): (Vec<String>, Vec<u32>) = sums.into_iter().unzip();

        let t = Instant::now();
        // One process holds the whole state: keep its nested structure, as
        // `torch.save(state_dict)` would. A rank of a larger job writes its tensors flat.
        let root = if ctx.world_size == 1 {
            root_for(&State {
                tensors: tensors.to_vec(),
                meta: ctx.meta.clone(),
            })
        } else {
            Value::Map(
                tensors
                    .iter()
                    .map(|t| (Key::Str(t.name.clone()), Value::Tensor(t.name.clone())))
                    .collect(),
            )
        };
        let a = archive(&root, tensors, &crcs)
            .map_err(|e| ckpt_core::Error::InvalidInput(format!(".pt: {e}")))?;
        ctx.stats.add_encode_time(t.elapsed());

        let key = ctx
            .data_prefix
            .clone()
            .join(ranged::rank_file(ctx.rank, "pt").as_str());
        put_object(ctx, &key, a.plan.parts).await?;
        let records = ranged::range_records(tensors, key.as_ref(), &a.offsets, hashes);
        Ok(WriteOutput {
            records,
            objects: vec![key.to_string()],
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ckpt_core::DType;

    fn nested() -> State {
        State::new()
            .with_tensor(Tensor::from_f32("model.w", vec![2, 2], &[1.0, 2.0, 3.0, -0.0]).unwrap())
            .with_tensor(
                Tensor::new(
                    "optimizer.state.0.exp_avg",
                    DType::BF16,
                    vec![3],
                    vec![1u8, 2, 3, 4, 5, 6],
                )
                .unwrap(),
            )
            .with_tensor(
                Tensor::new(
                    "optimizer.state.0.step",
                    DType::F8_E4M3,
                    vec![],
                    vec![0x38u8],
                )
                .unwrap(),
            )
            .with_tensor(Tensor::new("empty", DType::U64, vec![0], Vec::new()).unwrap())
            .with_meta(Value::map([
                (
                    "model",
                    Value::map([("w", Value::Tensor("model.w".into()))]),
                ),
                (
                    "optimizer",
                    Value::map([
                        (
                            "state",
                            Value::Map(vec![(
                                Key::Int(0),
                                Value::map([
                                    ("exp_avg", Value::Tensor("optimizer.state.0.exp_avg".into())),
                                    ("step", Value::Tensor("optimizer.state.0.step".into())),
                                ]),
                            )]),
                        ),
                        (
                            "param_groups",
                            Value::List(vec![Value::map([
                                ("lr", Value::Float(1e-3)),
                                (
                                    "betas",
                                    Value::Tuple(vec![Value::Float(0.9), Value::Float(0.999)]),
                                ),
                                ("params", Value::List(vec![Value::Int(0)])),
                                ("big", Value::Int(-(1 << 40))),
                                ("blob", Value::Bytes(vec![0, 200, 255])),
                                ("none", Value::Null),
                                ("flag", Value::Bool(true)),
                            ])]),
                        ),
                    ]),
                ),
                ("empty", Value::Tensor("empty".into())),
            ]))
    }

    #[test]
    fn nested_state_round_trips() {
        let s = nested();
        let bytes = Bytes::from(write_pt(&s).unwrap());
        assert_eq!(read_pt(&bytes).unwrap(), s);
    }

    #[test]
    fn flat_state_round_trips_with_null_meta() {
        let s = State::new()
            .with_tensor(Tensor::from_f32("a.b", vec![1], &[1.0]).unwrap())
            .with_tensor(
                Tensor::new("c", DType::I64, vec![], vec![9u8, 0, 0, 0, 0, 0, 0, 0]).unwrap(),
            );
        let bytes = Bytes::from(write_pt(&s).unwrap());
        assert_eq!(read_pt(&bytes).unwrap(), s);
    }

    #[test]
    fn unsupported_dtypes_and_damage_are_errors() {
        let s = State::new().with_tensor(Tensor::new("f4", DType::F4, vec![2], vec![0u8]).unwrap());
        assert!(write_pt(&s).is_err());
        let good = write_pt(&nested()).unwrap();
        for i in (0..good.len()).step_by(7) {
            let mut b = good.clone();
            b[i] ^= 0x5A;
            let _ = read_pt(&Bytes::from(b)); // never panics
        }
    }

    #[test]
    fn refuses_arbitrary_globals() {
        // `pickle.dumps(Evil())` where Evil.__reduce__ returns (os.system, ("echo hi",)).
        let evil = b"\x80\x02cposix\nsystem\nq\x00X\x07\x00\x00\x00echo hiq\x01\x85q\x02Rq\x03.";
        let err = unpickle::unpickle(evil).unwrap_err().to_string();
        assert!(
            err.contains("posix.system") && err.contains("refused"),
            "{err}"
        );
    }
}
