//! The router's Prometheus metrics: what is recorded beside the counters of
//! `RouterState` (histograms, HTTP responses: `histogram.rs`) and how
//! `/metrics` writes it all out (`exposition.rs`, `kv_tier.rs`), with the
//! vLLM and SGLang names gateways read (`gateway_names.rs`).

mod exposition;
mod gateway_names;
mod histogram;
mod kv_tier;

pub use exposition::render;
pub use gateway_names::EngineFacts;
pub use histogram::{Histogram, Metrics};
