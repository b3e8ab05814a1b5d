//! # ckpt-eval
//!
//! The benchmark suite of ckpt: experiments that measure checkpointing against the
//! machine's own limits and the usual alternatives, measured in the same run.
//!
//! - [`suite`]: the list of experiments, their shared options, a run of them;
//! - [`error`]: what an experiment can fail with;
//! - [`experiments`]: the `Experiment` trait and one module per experiment;
//! - [`models`] / [`workload`]: generated states shaped like real models;
//! - [`limits`]: memcpy, write + fsync and cold read floors;
//! - [`python`]: the Python baselines (torch.save, safetensors, DCP, h5py);
//! - [`noise`]: bounded local noise generators;
//! - [`train`]: a small real model for the bitwise resume check;
//! - [`table`] / [`plot`]: tables (text, Markdown, CSV) and SVG plots;
//! - [`report`] / [`html`]: `results.json`, `report.md`, `report.html`;
//! - [`interval`] / [`stats`]: Young/Daly and goodput arithmetic, medians and spread.
#![warn(missing_docs)]

pub mod error;
pub mod experiments;
pub mod html;
pub mod interval;
pub mod limits;
pub mod models;
pub mod noise;
pub mod plot;
pub mod python;
pub mod report;
pub mod rss;
pub mod stats;
pub mod suite;
pub mod table;
pub mod train;
pub mod workload;
