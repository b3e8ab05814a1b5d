//! Between an unpickled object tree and a ckpt [`State`].
//!
//! Reading: every tensor in the tree becomes a tensor of the state, named by its
//! path of keys joined with `.` (`optimizer.state.0.exp_avg`), and the tree itself
//! becomes the state's metadata with [`Value::Tensor`] leaves. A flat dict of
//! tensors keyed by their own names gives metadata [`Value::Null`], as ckpt writes
//! a flat state. Writing is the reverse ([`root_of`]).

use std::collections::{HashMap, HashSet};

use bytes::Bytes;
use ckpt_core::{Key, State, Tensor, Value};

use crate::error::CodecError;
use crate::torch::unpickle::{Id, Obj, Pickle, TensorRef};

/// Deepest nesting accepted (also what stops cycles).
pub const MAX_DEPTH: usize = 512;

/// Turn an unpickled tree into a state; `storage(key)` returns a storage's bytes.
pub fn to_state(
    p: &Pickle,
    storage: &dyn Fn(&str) -> Result<Bytes, CodecError>,
) -> Result<State, CodecError> {
    let mut b = Builder {
        p,
        storage,
        tensors: Vec::new(),
        names: HashSet::new(),
        by_id: HashMap::new(),
    };
    let meta = b.value(p.root, "", 0)?;
    let flat = match &meta {
        Value::Map(entries) => entries
            .iter()
            .all(|(k, v)| matches!((k, v), (Key::Str(k), Value::Tensor(n)) if k == n)),
        _ => false,
    };
    let meta = if flat { Value::Null } else { meta };
    Ok(State {
        tensors: b.tensors,
        meta,
    })
}

struct Builder<'a> {
    p: &'a Pickle,
    storage: &'a dyn Fn(&str) -> Result<Bytes, CodecError>,
    tensors: Vec<Tensor>,
    names: HashSet<String>,
    by_id: HashMap<Id, String>,
}

fn join(path: &str, key: &str) -> String {
    if path.is_empty() {
        key.to_owned()
    } else {
        format!("{path}.{key}")
    }
}

impl Builder<'_> {
    fn value(&mut self, id: Id, path: &str, depth: usize) -> Result<Value, CodecError> {
        if depth > MAX_DEPTH {
            return Err(CodecError::Malformed(
                "pickle nests too deeply (or is cyclic)".into(),
            ));
        }
        let p = self.p;
        Ok(match &p.objs[id] {
            Obj::None => Value::Null,
            Obj::Bool(b) => Value::Bool(*b),
            Obj::Int(i) => Value::Int(*i),
            Obj::Float(f) => Value::Float(*f),
            Obj::Str(s) => Value::Str(s.clone()),
            Obj::Bytes(b) => Value::Bytes(b.clone()),
            Obj::List(items) => Value::List(self.items(items, path, depth)?),
            Obj::Tuple(items) => Value::Tuple(self.items(items, path, depth)?),
            Obj::Dict(entries) => {
                let mut out = Vec::with_capacity(entries.len());
                for &(k, v) in entries {
                    let key = match &p.objs[k] {
                        Obj::Str(s) => Key::Str(s.clone()),
                        Obj::Int(i) => Key::Int(*i),
                        other => {
                            return Err(CodecError::Malformed(format!(
                                "dict key {other:?} is not a str or int"
                            )))
                        }
                    };
                    let sub = match &key {
                        Key::Str(s) => join(path, s),
                        Key::Int(i) => join(path, &i.to_string()),
                    };
                    out.push((key, self.value(v, &sub, depth + 1)?));
                }
                Value::Map(out)
            }
            Obj::Tensor(t) => Value::Tensor(self.tensor(id, t, path)?),
            Obj::Global(_) | Obj::Storage(_) => {
                return Err(CodecError::Malformed(
                    "a bare global or storage in the state is not plain data".into(),
                ))
            }
        })
    }

    fn items(&mut self, items: &[Id], path: &str, depth: usize) -> Result<Vec<Value>, CodecError> {
        items
            .iter()
            .enumerate()
            .map(|(i, &it)| self.value(it, &join(path, &i.to_string()), depth + 1))
            .collect()
    }

    fn tensor(&mut self, id: Id, t: &TensorRef, path: &str) -> Result<String, CodecError> {
        if let Some(n) = self.by_id.get(&id) {
            return Ok(n.clone());
        }
        let base = if path.is_empty() {
            "tensor".to_owned()
        } else {
            path.to_owned()
        };
        let mut name = base.clone();
        let mut n = 1;
        while self.names.contains(&name) {
            name = format!("{base}#{n}");
            n += 1;
        }
        let bytes = (self.storage)(&t.storage.key)?;
        let data = materialize(t, &bytes)?;
        let tensor = Tensor::new(name.clone(), t.dtype, t.size.clone(), data)
            .map_err(|e| CodecError::Malformed(format!("tensor `{name}`: {e}")))?;
        self.tensors.push(tensor);
        self.names.insert(name.clone());
        self.by_id.insert(id, name.clone());
        Ok(name)
    }
}

/// The bytes of a (possibly strided) view of a storage, checked against its bounds.
pub fn materialize(t: &TensorRef, storage: &Bytes) -> Result<Bytes, CodecError> {
    let bad = |s: &str| CodecError::Malformed(format!("tensor view: {s}"));
    let es = t.dtype.bits() / 8;
    if es == 0 || t.dtype.bits() % 8 != 0 {
        return Err(bad("sub-byte dtype"));
    }
    let storage_bytes = match t.storage.dtype {
        Some(d) => t.storage.numel.checked_mul(d.bits() / 8),
        None => Some(t.storage.numel),
    }
    .ok_or_else(|| bad("storage size overflows"))?;
    if storage_bytes != storage.len() as u64 {
        return Err(CodecError::Truncated(format!(
            "storage `{}` has {} bytes, the pickle says {storage_bytes}",
            t.storage.key,
            storage.len()
        )));
    }
    let numel = t
        .size
        .iter()
        .try_fold(1u64, |a, &d| a.checked_mul(d))
        .ok_or_else(|| bad("shape overflows"))?;
    if numel == 0 {
        return Ok(Bytes::new());
    }
    // Last element touched, in elements; must lie inside the storage.
    let last = t
        .size
        .iter()
        .zip(&t.stride)
        .try_fold(t.offset, |acc, (&d, &s)| {
            (d - 1).checked_mul(s).and_then(|x| acc.checked_add(x))
        });
    let last = last.ok_or_else(|| bad("strides overflow"))?;
    let end = last
        .checked_add(1)
        .and_then(|e| e.checked_mul(es))
        .ok_or_else(|| bad("strides overflow"))?;
    if end > storage.len() as u64 {
        return Err(bad("view runs past its storage"));
    }
    let contiguous = crate::torch::pickle::contiguous_strides(&t.size);
    let dense = t
        .size
        .iter()
        .zip(t.stride.iter().zip(&contiguous))
        .all(|(&d, (&s, &c))| d == 1 || s == c);
    let start = (t.offset * es) as usize;
    let len = (numel * es) as usize;
    if dense {
        return Ok(storage.slice(start..start + len));
    }
    // Gather a strided view, element by element, in row-major order.
    let es = es as usize;
    let mut out = Vec::with_capacity(len);
    let mut idx = vec![0u64; t.size.len()];
    for _ in 0..numel {
        let off = idx.iter().zip(&t.stride).map(|(&i, &s)| i * s).sum::<u64>() + t.offset;
        let at = off as usize * es;
        out.extend_from_slice(&storage[at..at + es]);
        for d in (0..idx.len()).rev() {
            idx[d] += 1;
            if idx[d] < t.size[d] {
                break;
            }
            idx[d] = 0;
        }
    }
    Ok(Bytes::from(out))
}

/// The object to pickle for a state: its metadata when that references every tensor;
/// a flat `{name: tensor}` dict when it has none; otherwise the metadata map with the
/// unreferenced tensors added under their names (a non-map is kept under `meta`).
pub fn root_of(state: &State) -> Value {
    let mut refs = Vec::new();
    state.meta.tensor_refs(&mut refs);
    let referenced: HashSet<&str> = refs.iter().map(String::as_str).collect();
    let loose: Vec<(Key, Value)> = state
        .tensors
        .iter()
        .filter(|t| !referenced.contains(t.name.as_str()))
        .map(|t| (Key::Str(t.name.clone()), Value::Tensor(t.name.clone())))
        .collect();
    match &state.meta {
        _ if loose.is_empty() && state.meta != Value::Null => state.meta.clone(),
        Value::Null => Value::Map(loose),
        Value::Map(entries) => Value::Map(entries.iter().cloned().chain(loose).collect()),
        other => Value::Map(
            std::iter::once((Key::from("meta"), other.clone()))
                .chain(loose)
                .collect(),
        ),
    }
}
