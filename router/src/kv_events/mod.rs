//! KV-cache events in vLLM's format, for the routers and gateways in front
//! of many servers (vllm-router's `kv_aware` policy, llm-d's KV-cache
//! indexer): `BlockStored`, `BlockRemoved` and `AllBlocksCleared` on a
//! ZeroMQ PUB socket with sequence numbers and a replay socket
//! (docs/kv_cache.md). The KV code records events as values (kv/events.rs);
//! this module configures (config.rs), merges the data-parallel groups'
//! streams (merge.rs), encodes (wire.rs), buffers for replay (replay.rs) and
//! publishes (publisher.rs).

pub mod config;
pub mod merge;
pub mod publisher;
pub mod replay;
pub mod wire;

pub use config::KvEventsConfig;
pub use publisher::{start, EventSink};
pub use wire::Layout;

/// The publisher `--kv-events-config` asks for, started; None when it asks for none.
pub async fn from_config(config: Option<&KvEventsConfig>, layout: Layout) -> Result<Option<EventSink>, String> {
    match config {
        Some(c) if c.publishes() => Ok(Some(start(c, layout).await?)),
        Some(_) => {
            tracing::warn!(
                "--kv-events-config: nothing is published without \"enable_kv_cache_events\": true (as in vLLM)"
            );
            Ok(None)
        }
        None => Ok(None),
    }
}
