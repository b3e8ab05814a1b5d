//! A training state: named tensors plus plain-data metadata.

use std::collections::HashSet;

use crate::error::{Error, Result};
use crate::model::tensor::Tensor;
use crate::model::value::Value;

/// What a checkpoint holds: tensors by unique name, and non-tensor state as [`Value`].
#[derive(Debug, Clone, Default, PartialEq)]
pub struct State {
    /// The tensors, in the order they were added.
    pub tensors: Vec<Tensor>,
    /// Step, RNG state, scalars, config, the structure of nested state dicts.
    pub meta: Value,
}

impl State {
    /// An empty state.
    pub fn new() -> Self {
        State::default()
    }

    /// Add a tensor (builder style).
    pub fn with_tensor(mut self, tensor: Tensor) -> Self {
        self.tensors.push(tensor);
        self
    }

    /// Set the metadata (builder style).
    pub fn with_meta(mut self, meta: Value) -> Self {
        self.meta = meta;
        self
    }

    /// Find a tensor by name.
    pub fn tensor(&self, name: &str) -> Option<&Tensor> {
        self.tensors.iter().find(|t| t.name == name)
    }

    /// Total bytes of tensor data.
    pub fn nbytes(&self) -> u64 {
        self.tensors.iter().map(|t| t.data.len() as u64).sum()
    }

    /// Check every tensor, and that names are unique.
    pub fn validate(&self) -> Result<()> {
        let mut seen = HashSet::with_capacity(self.tensors.len());
        for t in &self.tensors {
            t.validate()?;
            if !seen.insert(t.name.as_str()) {
                return Err(Error::InvalidInput(format!(
                    "duplicate tensor name `{}`",
                    t.name
                )));
            }
        }
        Ok(())
    }
}
