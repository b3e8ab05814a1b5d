//! The metadata layout of the `ckpt` Python package, seen as plain state dicts.
//!
//! The Python package saves `{"model": ..., "optimizer": ..., "extra": ...}` as
//! named tensors (`model.fc.weight`, `optimizer.state.0.exp_avg`) and the metadata
//!
//! ```text
//! {"ckpt": {"version": 1, "numpy": [...], "local": {...}},   ckpt's own bookkeeping
//!  "state": <the nested state, tensors as references>}
//! ```
//!
//! where exact Python types are tagged: an `OrderedDict` is
//! `{"__ckpt__": "odict", "items": {...}, "metadata": ...}`, a numpy scalar
//! `{"__ckpt__": "np_scalar", "value": ...}`. Each rank's own state (its RNG) is a
//! `U8` tensor `__rank<r>__` holding an encoded tree whose tensors are named
//! `__rank<r>__.rng.torch`, ... The manifest keeps this tree, so ckpt restores exact
//! types; files meant for other readers show the [`plain`] view instead: the state
//! as the user passed it (state dicts that `load_state_dict` takes as they are), and
//! everything ckpt-internal under the one key [`INTERNAL_KEY`].

use std::collections::HashSet;

use ckpt_core::{Key, Tensor, Value};

use ckpt_core::layout::pymeta;

/// The top-level key of a `.pt` file under which ckpt keeps its internal state:
/// `{"ckpt": <bookkeeping>, "rank0": {"rng": {...}}, "tensors": {...}}`. The Python
/// package refuses this key in user state, so it never collides.
pub const INTERNAL_KEY: &str = "__ckpt__";

/// The Python package's `(bookkeeping, state)` if `meta` has its layout
/// ([`ckpt_core::layout::pymeta`]).
pub fn python_state(meta: &Value) -> Option<(&Value, &Value)> {
    let info = meta.get(pymeta::INFO_KEY)?;
    let state = meta.get(pymeta::STATE_KEY)?;
    match (meta, info.get("version")) {
        (Value::Map(entries), Some(Value::Int(_))) if entries.len() == 2 => Some((info, state)),
        _ => None,
    }
}

/// True for the name of a tensor that holds ckpt-internal state (`__rank3__`,
/// `__rank3__.rng.torch`), never a user's.
pub fn is_internal(name: &str) -> bool {
    pymeta::own_rank(name).is_some()
}

/// The tree with the Python type tags removed: an `OrderedDict` becomes its items
/// (a plain dict: `load_state_dict` takes it), a numpy scalar its 0-d tensor.
pub fn plain(v: &Value) -> Value {
    match v {
        Value::Map(entries) => match v.get(pymeta::TYPE_TAG) {
            Some(Value::Str(tag)) if tag == pymeta::ODICT_TAG => {
                v.get("items").map(plain).unwrap_or(Value::Map(Vec::new()))
            }
            Some(Value::Str(tag)) if tag == pymeta::NP_SCALAR_TAG => {
                v.get("value").map(plain).unwrap_or(Value::Null)
            }
            _ => Value::Map(entries.iter().map(|(k, v)| (k.clone(), plain(v))).collect()),
        },
        Value::List(items) => Value::List(items.iter().map(plain).collect()),
        Value::Tuple(items) => Value::Tuple(items.iter().map(plain).collect()),
        other => other.clone(),
    }
}

/// The tree of the rank-local state held in tensor `t` (`__rank<r>__`), plain.
fn local_tree(t: &Tensor) -> Option<Value> {
    let v: Value = serde_json::from_slice(&t.data).ok()?;
    let rank = pymeta::own_rank(&t.name)?;
    pymeta::OwnState::from_value(&v, rank)
        .ok()
        .map(|own| plain(&own.tree))
}

/// The object a plain-reader file holds for a state with the Python package's
/// metadata: the plain state at the top, ckpt's bookkeeping, each rank's own state
/// (`rank<r>`) and any other tensor the state does not reference under
/// [`INTERNAL_KEY`]. `None` when `meta` is not the Python package's.
pub fn plain_root(meta: &Value, tensors: &[Tensor]) -> Option<Value> {
    let (info, state) = python_state(meta)?;
    let Value::Map(top) = plain(state) else {
        return None;
    };
    let mut referenced = Vec::new();
    state.tensor_refs(&mut referenced);
    let mut placed: HashSet<String> = referenced.into_iter().collect();
    let mut internal = vec![(Key::from("ckpt"), info.clone())];
    for t in tensors {
        // `__rank<r>__` itself (no dot): the encoded tree of rank r's own state.
        let rank = t
            .name
            .strip_prefix("__rank")
            .and_then(|r| r.strip_suffix("__"));
        let (Some(rank), true) = (rank, is_internal(&t.name)) else {
            continue;
        };
        let Some(tree) = local_tree(t) else {
            continue; // not decodable: it stays a loose tensor under "tensors"
        };
        let mut refs = Vec::new();
        tree.tensor_refs(&mut refs);
        placed.extend(refs);
        placed.insert(t.name.clone());
        internal.push((Key::Str(format!("rank{rank}")), tree));
    }
    let loose: Vec<(Key, Value)> = tensors
        .iter()
        .filter(|t| !placed.contains(&t.name))
        .map(|t| (Key::Str(t.name.clone()), Value::Tensor(t.name.clone())))
        .collect();
    if !loose.is_empty() {
        internal.push((Key::from("tensors"), Value::Map(loose)));
    }
    let mut root = top;
    root.push((Key::from(INTERNAL_KEY), Value::Map(internal)));
    Some(Value::Map(root))
}

/// Every tensor under `v` with its key path joined by `.` (as a state dict names
/// it), first occurrence only, in tree order.
pub fn tensor_paths(v: &Value, path: &str, out: &mut Vec<(String, String)>) {
    let join = |k: &str| {
        if path.is_empty() {
            k.to_owned()
        } else {
            format!("{path}.{k}")
        }
    };
    match v {
        Value::Tensor(name) if !out.iter().any(|(_, n)| n == name) => {
            out.push((path.to_owned(), name.clone()));
        }
        Value::Map(entries) => {
            for (k, v) in entries {
                let k = match k {
                    Key::Str(s) => join(s),
                    Key::Int(i) => join(&i.to_string()),
                };
                tensor_paths(v, &k, out);
            }
        }
        Value::List(items) | Value::Tuple(items) => {
            for (i, v) in items.iter().enumerate() {
                tensor_paths(v, &join(&i.to_string()), out);
            }
        }
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What the Python package stores for `save(s, model=m)` with its RNG.
    pub fn python_meta() -> (Value, Vec<Tensor>) {
        let odict = Value::map([
            ("__ckpt__", Value::Str("odict".into())),
            (
                "items",
                Value::map([("fc.weight", Value::Tensor("model.fc.weight".into()))]),
            ),
            (
                "metadata",
                Value::map([("", Value::map([("version", Value::Int(1))]))]),
            ),
        ]);
        let meta = Value::map([
            ("ckpt", Value::map([("version", Value::Int(1))])),
            (
                "state",
                Value::map([
                    ("model", odict),
                    ("extra", Value::map([("epoch", Value::Int(3))])),
                ]),
            ),
        ]);
        let local = Value::map([(
            "tree",
            Value::map([(
                "rng",
                Value::map([("torch", Value::Tensor("__rank0__.rng.torch".into()))]),
            )]),
        )]);
        let blob = serde_json::to_vec(&local).unwrap();
        let tensors = vec![
            Tensor::from_f32("model.fc.weight", vec![2], &[1.0, 2.0]).unwrap(),
            Tensor::new(
                "__rank0__.rng.torch",
                ckpt_core::DType::U8,
                vec![3],
                vec![1u8, 2, 3],
            )
            .unwrap(),
            Tensor::new(
                "__rank0__",
                ckpt_core::DType::U8,
                vec![blob.len() as u64],
                blob,
            )
            .unwrap(),
        ];
        (meta, tensors)
    }

    #[test]
    fn plain_root_strips_tags_and_gathers_internals_under_one_key() {
        let (meta, tensors) = python_meta();
        let root = plain_root(&meta, &tensors).unwrap();
        assert_eq!(
            root.get("model"),
            Some(&Value::map([(
                "fc.weight",
                Value::Tensor("model.fc.weight".into())
            )]))
        );
        assert_eq!(
            root.get("extra"),
            Some(&Value::map([("epoch", Value::Int(3))]))
        );
        let internal = root.get(INTERNAL_KEY).unwrap();
        assert_eq!(
            internal
                .get("rank0")
                .and_then(|r| r.get("rng"))
                .and_then(|r| r.get("torch")),
            Some(&Value::Tensor("__rank0__.rng.torch".into()))
        );
        assert!(internal.get("ckpt").is_some());
        assert!(internal.get("tensors").is_none(), "{internal:?}");
        let keys: Vec<_> = match &root {
            Value::Map(e) => e.iter().map(|(k, _)| k.clone()).collect(),
            _ => unreachable!(),
        };
        assert_eq!(
            keys,
            [
                Key::from("model"),
                Key::from("extra"),
                Key::from(INTERNAL_KEY)
            ]
        );
    }

    #[test]
    fn other_layouts_are_left_alone() {
        assert!(plain_root(&Value::Null, &[]).is_none());
        let rust = Value::map([("model", Value::Tensor("model.w".into()))]);
        assert!(plain_root(&rust, &[]).is_none());
    }

    #[test]
    fn internal_names() {
        for n in ["__rank0__", "__rank12__.rng.torch"] {
            assert!(is_internal(n), "{n}");
        }
        for n in [
            "model.__rank0__",
            "__rank__",
            "__rankx__",
            "rank0",
            "__rank0",
        ] {
            assert!(!is_internal(n), "{n}");
        }
    }
}
