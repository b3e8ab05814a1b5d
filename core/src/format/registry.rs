//! [`FormatRegistry`]: the formats a checkpointer can read, by the name a
//! manifest records.

use std::collections::HashMap;
use std::sync::Arc;

use crate::error::{Error, Result};
use crate::format::Format;

/// Formats by name, for loading checkpoints written in any of them.
#[derive(Debug, Clone, Default)]
pub struct FormatRegistry {
    formats: HashMap<String, Arc<dyn Format>>,
}

impl FormatRegistry {
    /// An empty registry.
    pub fn new() -> Self {
        Self::default()
    }

    /// Register a format under its name (replacing one of the same name).
    pub fn register(&mut self, format: Arc<dyn Format>) -> &mut Self {
        self.formats.insert(format.name().to_owned(), format);
        self
    }

    /// Look a format up by name.
    pub fn get(&self, name: &str) -> Result<Arc<dyn Format>> {
        self.formats
            .get(name)
            .cloned()
            .ok_or_else(|| Error::Unsupported(format!("no reader registered for format `{name}`")))
    }

    /// Names of the registered formats.
    pub fn names(&self) -> Vec<&str> {
        let mut v: Vec<&str> = self.formats.keys().map(String::as_str).collect();
        v.sort_unstable();
        v
    }
}
