//! The sharded-checkpoint index of the Hugging Face convention
//! (`model.safetensors.index.json`): which file holds which tensor.

use std::collections::BTreeMap;

use serde_json::json;

use crate::error::CodecError;

/// Largest index file the parser accepts.
pub const MAX_INDEX_BYTES: usize = 64 << 20;

/// A parsed or to-be-written index.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Index {
    /// Total tensor bytes over all files (`metadata.total_size`).
    pub total_size: u64,
    /// Tensor name to file name (relative to the index), sorted by name.
    pub weight_map: BTreeMap<String, String>,
}

impl Index {
    /// An index over `(tensor, file)` pairs.
    pub fn new(total_size: u64, weight_map: impl IntoIterator<Item = (String, String)>) -> Self {
        Index {
            total_size,
            weight_map: weight_map.into_iter().collect(),
        }
    }

    /// Encode as JSON.
    pub fn to_json(&self) -> Result<Vec<u8>, CodecError> {
        serde_json::to_vec_pretty(&json!({
            "metadata": {"total_size": self.total_size},
            "weight_map": self.weight_map,
        }))
        .map_err(|e| CodecError::Malformed(e.to_string()))
    }

    /// Parse an index; file names must be plain names (no paths that climb out).
    pub fn parse(bytes: &[u8]) -> Result<Index, CodecError> {
        if bytes.len() > MAX_INDEX_BYTES {
            return Err(CodecError::TooLarge(format!(
                "index of {} bytes",
                bytes.len()
            )));
        }
        let v: serde_json::Value = serde_json::from_slice(bytes)
            .map_err(|e| CodecError::Malformed(format!("index: {e}")))?;
        let total_size = v
            .pointer("/metadata/total_size")
            .and_then(|t| t.as_u64())
            .unwrap_or(0);
        let map = v
            .get("weight_map")
            .and_then(|m| m.as_object())
            .ok_or_else(|| CodecError::Malformed("index has no weight_map".into()))?;
        let mut weight_map = BTreeMap::new();
        for (name, file) in map {
            let file = file
                .as_str()
                .filter(|f| {
                    !f.is_empty()
                        && !f.contains('/')
                        && !f.contains('\\')
                        && *f != "."
                        && *f != ".."
                })
                .ok_or_else(|| CodecError::Malformed(format!("index: bad file for `{name}`")))?;
            weight_map.insert(name.clone(), file.to_owned());
        }
        Ok(Index {
            total_size,
            weight_map,
        })
    }

    /// The distinct files, sorted.
    pub fn files(&self) -> Vec<&str> {
        let mut f: Vec<&str> = self.weight_map.values().map(String::as_str).collect();
        f.sort_unstable();
        f.dedup();
        f
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_rejects_escapes() {
        let i = Index::new(
            12,
            [
                ("a".into(), "m-1.safetensors".into()),
                ("b".into(), "m-2.safetensors".into()),
            ],
        );
        assert_eq!(Index::parse(&i.to_json().unwrap()).unwrap(), i);
        assert_eq!(i.files(), vec!["m-1.safetensors", "m-2.safetensors"]);
        assert!(Index::parse(br#"{"weight_map": {"a": "../x"}}"#).is_err());
        assert!(Index::parse(br#"{"weight_map": {"a": 3}}"#).is_err());
        assert!(Index::parse(b"[").is_err());
    }
}
