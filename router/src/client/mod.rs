//! gRPC client to the shards over unix sockets.

mod shard;
mod sharded;

pub use shard::{ShardAddr, ShardAuth, ShardClient};
pub use sharded::ShardedClient;
