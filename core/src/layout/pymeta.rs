//! The schema of the metadata the `ckpt` Python package writes, defined once:
//! the Python package builds and reads it through the extension
//! (`ckpt._ckpt.meta`, `read_meta`, `own_name`, the tag constants), and
//! [`crate::pylayout`] reads it for exports.
//!
//! ```text
//! {"ckpt": {"version": 1, "numpy": [...], "local": {"ranks": N}, "memory": {"rank": r, "ranks": N}},
//!  "state": <the nested state, tensors as references, exact types tagged>}
//! ```
//!
//! - `numpy`: the tensors saved from numpy arrays (they load as arrays);
//! - `local`: present when every rank saved its own state (its RNG), each in a
//!   `U8` tensor named [`own_name`] holding `{"tree": ..., "numpy": [...]}`;
//! - `memory`: on a memory-tier root, which rank of how many wrote it.
//!
//! Nodes of the state whose exact Python type matters carry it under
//! [`TYPE_TAG`]: an `OrderedDict` is `{"__ckpt__": "odict", "items": {...},
//! "metadata": ...}`, a numpy scalar `{"__ckpt__": "np_scalar", "value": ...}`.

use crate::error::{Error, Result};
use crate::model::{Key, Value};

/// The version of this schema, written into every checkpoint's metadata; a
/// checkpoint with another one is [`Error::Unsupported`] here.
pub const META_VERSION: i64 = 1;
/// The metadata's key of ckpt's own bookkeeping.
pub const INFO_KEY: &str = "ckpt";
/// The metadata's key of the saved state.
pub const STATE_KEY: &str = "state";
/// The key under which a node of the state tree carries its exact Python type.
pub const TYPE_TAG: &str = "__ckpt__";
/// [`TYPE_TAG`]'s value for an `OrderedDict` (with `items` and `metadata`).
pub const ODICT_TAG: &str = "odict";
/// [`TYPE_TAG`]'s value for a numpy scalar (with `value`).
pub const NP_SCALAR_TAG: &str = "np_scalar";

/// The name of the tensor holding rank `rank`'s own tree, and the prefix
/// (`__rank3__.`) of the tensors in it.
pub fn own_name(rank: u64) -> String {
    format!("__rank{rank}__")
}

/// The rank whose own state tensor `name` belongs to (`__rank3__`,
/// `__rank3__.rng.torch`), or `None` for a user's tensor.
pub fn own_rank(name: &str) -> Option<u64> {
    let head = name.split('.').next().unwrap_or(name);
    let digits = head.strip_prefix("__rank")?.strip_suffix("__")?;
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}

/// ckpt's bookkeeping in a checkpoint's metadata (the [`INFO_KEY`] entry).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Bookkeeping {
    /// Tensors saved from numpy arrays.
    pub numpy: Vec<String>,
    /// How many ranks saved their own state; `None` when none did.
    pub ranks: Option<u64>,
    /// On a memory-tier root: `(rank, ranks)` of the writer.
    pub memory: Option<(u64, u64)>,
}

fn int(v: u64) -> Value {
    Value::Int(i64::try_from(v).unwrap_or(i64::MAX))
}

fn uint(v: Option<&Value>) -> Option<u64> {
    match v {
        Some(Value::Int(i)) => u64::try_from(*i).ok(),
        _ => None,
    }
}

impl Bookkeeping {
    /// The [`INFO_KEY`] entry as stored, with [`META_VERSION`].
    pub fn to_value(&self) -> Value {
        let mut entries: Vec<(Key, Value)> = vec![
            (Key::from("version"), Value::Int(META_VERSION)),
            (
                Key::from("numpy"),
                Value::List(self.numpy.iter().cloned().map(Value::Str).collect()),
            ),
        ];
        if let Some(n) = self.ranks {
            entries.push((Key::from("local"), Value::map([("ranks", int(n))])));
        }
        if let Some((rank, ranks)) = self.memory {
            let m = Value::map([("rank", int(rank)), ("ranks", int(ranks))]);
            entries.push((Key::from("memory"), m));
        }
        Value::Map(entries)
    }

    /// The bookkeeping of a stored [`INFO_KEY`] entry; [`Error::Unsupported`]
    /// for another version or a shape this build does not know.
    pub fn from_value(info: &Value) -> Result<Self> {
        let Value::Map(_) = info else {
            return Err(not_ours());
        };
        match info.get("version") {
            Some(Value::Int(v)) if *v == META_VERSION => {}
            other => {
                let v = match other {
                    Some(Value::Int(v)) => v.to_string(),
                    _ => "none".to_owned(),
                };
                return Err(Error::Unsupported(format!(
                    "checkpoint metadata version {v} (this ckpt reads {META_VERSION})"
                )));
            }
        }
        let numpy = match info.get("numpy") {
            None => Vec::new(),
            Some(Value::List(items)) => items
                .iter()
                .map(|v| match v {
                    Value::Str(s) => Ok(s.clone()),
                    _ => Err(Error::Unsupported(
                        "checkpoint metadata: numpy names that are not strings".into(),
                    )),
                })
                .collect::<Result<_>>()?,
            Some(_) => {
                return Err(Error::Unsupported(
                    "checkpoint metadata: numpy is not a list".into(),
                ))
            }
        };
        let ranks = info.get("local").and_then(|l| uint(l.get("ranks")));
        let memory = info
            .get("memory")
            .and_then(|m| Some((uint(m.get("rank"))?, uint(m.get("ranks"))?)));
        Ok(Bookkeeping {
            numpy,
            ranks,
            memory,
        })
    }
}

fn not_ours() -> Error {
    Error::Unsupported("this checkpoint was not written by the ckpt Python package".into())
}

/// The metadata of a checkpoint: the bookkeeping and the state.
pub fn meta(info: &Bookkeeping, state: Value) -> Value {
    Value::map([(INFO_KEY, info.to_value()), (STATE_KEY, state)])
}

/// The bookkeeping and the state of metadata the Python package wrote;
/// [`Error::Unsupported`] for any other metadata or version.
pub fn read_meta(meta: &Value) -> Result<(Bookkeeping, &Value)> {
    let (Some(info), Some(state @ Value::Map(_))) = (meta.get(INFO_KEY), meta.get(STATE_KEY))
    else {
        return Err(not_ours());
    };
    Ok((Bookkeeping::from_value(info)?, state))
}

/// A rank's own state as its [`own_name`] tensor holds it (encoded as a
/// manifest stores metadata): its tree and the tensors in it saved from numpy.
#[derive(Debug, Clone, PartialEq)]
pub struct OwnState {
    /// The tree (`{"rng": ...}`), its tensors named under [`own_name`]'s prefix.
    pub tree: Value,
    /// Its tensors saved from numpy arrays.
    pub numpy: Vec<String>,
}

impl OwnState {
    /// The value the tensor holds.
    pub fn to_value(&self) -> Value {
        let numpy = Value::List(self.numpy.iter().cloned().map(Value::Str).collect());
        Value::map([("tree", self.tree.clone()), ("numpy", numpy)])
    }

    /// The own state a tensor of rank `rank` holds; [`Error::Unsupported`]
    /// when it holds something else.
    pub fn from_value(v: &Value, rank: u64) -> Result<Self> {
        let bad = || {
            Error::Unsupported(format!(
                "tensor {:?} does not hold a rank's own state",
                own_name(rank)
            ))
        };
        let tree = v.get("tree").ok_or_else(bad)?.clone();
        let numpy = match v.get("numpy") {
            None => Vec::new(),
            Some(Value::List(items)) => items
                .iter()
                .map(|i| match i {
                    Value::Str(s) => Ok(s.clone()),
                    _ => Err(bad()),
                })
                .collect::<Result<_>>()?,
            Some(_) => return Err(bad()),
        };
        Ok(OwnState { tree, numpy })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bookkeeping_round_trips_and_versions_are_checked() {
        let b = Bookkeeping {
            numpy: vec!["x".into()],
            ranks: Some(4),
            memory: Some((1, 4)),
        };
        let m = meta(&b, Value::map([("w", Value::Tensor("w".into()))]));
        let (back, state) = read_meta(&m).unwrap();
        assert_eq!(back, b);
        assert_eq!(state.get("w"), Some(&Value::Tensor("w".into())));
        let newer = Value::map([
            (
                INFO_KEY,
                Value::map([("version", Value::Int(META_VERSION + 1))]),
            ),
            (STATE_KEY, Value::map::<&str>([])),
        ]);
        let e = read_meta(&newer).unwrap_err();
        assert!(
            matches!(&e, Error::Unsupported(m) if m.contains("version 2")),
            "{e}"
        );
        for other in [
            Value::Null,
            Value::map([("state", Value::map::<&str>([]))]),
            Value::map([
                (INFO_KEY, Value::Int(1)),
                (STATE_KEY, Value::map::<&str>([])),
            ]),
            Value::map([(INFO_KEY, b.to_value()), (STATE_KEY, Value::Int(3))]),
        ] {
            assert!(
                matches!(read_meta(&other), Err(Error::Unsupported(_))),
                "{other:?}"
            );
        }
    }

    #[test]
    fn a_bare_bookkeeping_reads_as_no_ranks_and_no_numpy() {
        let info = Value::map([("version", Value::Int(META_VERSION))]);
        assert_eq!(
            Bookkeeping::from_value(&info).unwrap(),
            Bookkeeping::default()
        );
    }

    #[test]
    fn own_state_round_trips_and_refuses_other_trees() {
        let own = OwnState {
            tree: Value::map([("rng", Value::Tensor("__rank2__.rng.torch".into()))]),
            numpy: vec!["__rank2__.rng.numpy".into()],
        };
        assert_eq!(OwnState::from_value(&own.to_value(), 2).unwrap(), own);
        let e = OwnState::from_value(&Value::map([("x", Value::Null)]), 2).unwrap_err();
        assert!(
            matches!(&e, Error::Unsupported(m) if m.contains("__rank2__")),
            "{e}"
        );
    }

    #[test]
    fn own_names_are_told_from_users_names() {
        assert_eq!(own_name(3), "__rank3__");
        assert_eq!(own_rank("__rank3__"), Some(3));
        assert_eq!(own_rank("__rank12__.rng.torch"), Some(12));
        for user in [
            "__rank__",
            "__rankx__",
            "rank3",
            "__rank3",
            "model.__rank3__",
        ] {
            assert_eq!(own_rank(user), None, "{user}");
        }
    }
}
