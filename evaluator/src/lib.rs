//! # ckpt-eval
//!
//! The benchmark suite of ckpt: experiments that measure checkpointing against the
//! machine's own limits and the usual alternatives, measured in the same run.
#![warn(missing_docs)]

pub mod experiments;
pub mod interval;
pub mod limits;
pub mod rss;
pub mod stats;
pub mod workload;
