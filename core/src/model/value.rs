//! Non-tensor state as plain data: no pickle, nothing that runs code on load.

use serde::{Deserialize, Serialize};

/// A key of a [`Value::Map`]: Python dicts in state dicts have string or int keys.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(untagged)]
pub enum Key {
    /// Integer key (e.g. optimizer state indexed by parameter id).
    Int(i64),
    /// String key.
    Str(String),
}

impl From<&str> for Key {
    fn from(s: &str) -> Self {
        Key::Str(s.to_owned())
    }
}

impl From<i64> for Key {
    fn from(i: i64) -> Self {
        Key::Int(i)
    }
}

/// Plain data: the step, RNG seeds, scalars, config, and the structure of nested
/// state dicts (tensors appear as [`Value::Tensor`] references by name).
///
/// Floats round-trip bit for bit, NaN payloads and infinities included.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
#[serde(tag = "t", content = "v", rename_all = "lowercase")]
pub enum Value {
    /// Nothing (Python `None`).
    #[default]
    Null,
    /// A boolean.
    Bool(bool),
    /// A signed 64-bit integer.
    Int(i64),
    /// A 64-bit float, stored exactly.
    Float(#[serde(with = "exact_f64")] f64),
    /// A UTF-8 string.
    Str(String),
    /// Raw bytes (stored as hex).
    Bytes(#[serde(with = "hex_bytes")] Vec<u8>),
    /// An ordered list.
    List(Vec<Value>),
    /// A tuple (kept apart from lists so Python gets back the same type).
    Tuple(Vec<Value>),
    /// An ordered map with string or integer keys.
    Map(Vec<(Key, Value)>),
    /// A reference to a tensor of the same state, by name.
    Tensor(String),
}

impl Value {
    /// Look a string key up in a map.
    pub fn get(&self, key: &str) -> Option<&Value> {
        match self {
            Value::Map(entries) => entries.iter().find_map(|(k, v)| match k {
                Key::Str(s) if s == key => Some(v),
                _ => None,
            }),
            _ => None,
        }
    }

    /// Build a map from string keys.
    pub fn map<K: Into<Key>>(entries: impl IntoIterator<Item = (K, Value)>) -> Value {
        Value::Map(entries.into_iter().map(|(k, v)| (k.into(), v)).collect())
    }

    /// The integer, if this is one.
    pub fn as_int(&self) -> Option<i64> {
        match self {
            Value::Int(i) => Some(*i),
            _ => None,
        }
    }

    /// Every tensor name referenced anywhere inside this value.
    pub fn tensor_refs(&self, out: &mut Vec<String>) {
        match self {
            Value::Tensor(name) => out.push(name.clone()),
            Value::List(items) | Value::Tuple(items) => {
                items.iter().for_each(|v| v.tensor_refs(out))
            }
            Value::Map(entries) => entries.iter().for_each(|(_, v)| v.tensor_refs(out)),
            _ => {}
        }
    }
}

mod exact_f64 {
    //! Finite floats as JSON numbers (serde_json round-trips them exactly);
    //! anything else as a string holding its bits.
    use serde::{de::Error as _, Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(v: &f64, s: S) -> Result<S::Ok, S::Error> {
        if v.is_finite() {
            s.serialize_f64(*v)
        } else {
            s.serialize_str(&format!("f64:{:016x}", v.to_bits()))
        }
    }

    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Repr {
        Num(f64),
        Bits(String),
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<f64, D::Error> {
        match Repr::deserialize(d)? {
            Repr::Num(v) => Ok(v),
            Repr::Bits(s) => {
                let hex = s
                    .strip_prefix("f64:")
                    .ok_or_else(|| D::Error::custom("bad float"))?;
                u64::from_str_radix(hex, 16)
                    .map(f64::from_bits)
                    .map_err(|_| D::Error::custom("bad float bits"))
            }
        }
    }
}

mod hex_bytes {
    use serde::{de::Error as _, Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(v: &[u8], s: S) -> Result<S::Ok, S::Error> {
        let mut out = String::with_capacity(v.len() * 2);
        for b in v {
            out.push_str(&format!("{b:02x}"));
        }
        s.serialize_str(&out)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<u8>, D::Error> {
        let s = String::deserialize(d)?;
        if s.len() % 2 != 0 {
            return Err(D::Error::custom("odd hex length"));
        }
        (0..s.len())
            .step_by(2)
            .map(|i| {
                s.get(i..i + 2)
                    .and_then(|h| u8::from_str_radix(h, 16).ok())
                    .ok_or_else(|| D::Error::custom("bad hex"))
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn arb_value() -> impl Strategy<Value = Value> {
        let leaf = prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::Bool),
            any::<i64>().prop_map(Value::Int),
            any::<u64>().prop_map(|b| Value::Float(f64::from_bits(b))),
            ".*".prop_map(Value::Str),
            proptest::collection::vec(any::<u8>(), 0..16).prop_map(Value::Bytes),
            "[a-z.]{1,8}".prop_map(Value::Tensor),
        ];
        leaf.prop_recursive(4, 32, 6, |inner| {
            prop_oneof![
                proptest::collection::vec(inner.clone(), 0..6).prop_map(Value::List),
                proptest::collection::vec(inner.clone(), 0..6).prop_map(Value::Tuple),
                proptest::collection::vec(
                    (
                        prop_oneof![any::<i64>().prop_map(Key::Int), ".*".prop_map(Key::Str)],
                        inner
                    ),
                    0..6
                )
                .prop_map(Value::Map),
            ]
        })
    }

    /// Equality that compares floats by bits, so NaN payloads count.
    fn bit_eq(a: &Value, b: &Value) -> bool {
        match (a, b) {
            (Value::Float(x), Value::Float(y)) => x.to_bits() == y.to_bits(),
            (Value::List(x), Value::List(y)) | (Value::Tuple(x), Value::Tuple(y)) => {
                x.len() == y.len() && x.iter().zip(y).all(|(a, b)| bit_eq(a, b))
            }
            (Value::Map(x), Value::Map(y)) => {
                x.len() == y.len()
                    && x.iter()
                        .zip(y)
                        .all(|((ka, a), (kb, b))| ka == kb && bit_eq(a, b))
            }
            _ => a == b,
        }
    }

    proptest! {
        #[test]
        fn json_round_trip_is_exact(v in arb_value()) {
            let json = serde_json::to_vec(&v).unwrap();
            let back: Value = serde_json::from_slice(&json).unwrap();
            prop_assert!(bit_eq(&v, &back), "{v:?} != {back:?}");
        }
    }

    #[test]
    fn keys_keep_their_type() {
        let v = Value::map([
            (Key::Int(0), Value::Int(1)),
            (Key::from("0"), Value::Int(2)),
        ]);
        let back: Value = serde_json::from_str(&serde_json::to_string(&v).unwrap()).unwrap();
        assert_eq!(v, back);
    }
}
