//! LoRA adapters on the router's side: which adapters are served
//! (registry.rs), their directories checked (adapter_config.rs), and the
//! `--lora-modules` values (modules.rs). The value every lower layer carries
//! is `crate::adapter::Adapter`.

pub mod adapter_config;
pub mod modules;
pub mod registry;

pub use modules::LoraModule;
pub use registry::{LoraLimits, LoraRegistry};
