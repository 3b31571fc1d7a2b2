//! The router's Prometheus metrics: what is recorded beside the counters of
//! `RouterState` (histograms, HTTP responses: `histogram.rs`) and how
//! `/metrics` writes it all out (`exposition.rs`, `kv_tier.rs`).

mod exposition;
mod histogram;
mod kv_tier;

pub use exposition::render;
pub use histogram::{Histogram, Metrics};
