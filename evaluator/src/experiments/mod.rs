//! The experiments of `ckpt-eval`, one module each.

pub mod engine;
