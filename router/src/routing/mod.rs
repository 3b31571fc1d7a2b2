//! Data-parallel routing: which shard group a request runs on (not where a
//! shard's threads run: that is the shard's own CPU pinning). The router
//! owns every group's radix tree, so the prefix each group holds for a
//! prompt is known exactly (no approximate shadow index, no KV event feed),
//! and so are the prompts it placed that are not cached yet (`placed.rs`):
//! `rule.rs` turns those and each group's load into a choice (a pure
//! function), `placer.rs` gathers the figures and sends the request to the
//! chosen group's batching loop.

mod placed;
mod placer;
pub mod rule;

pub use placer::{Arrival, GroupHandle, Placer};
pub use rule::{choose, GroupLoad, Routing};
