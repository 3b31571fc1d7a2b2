//! Starting the data-parallel shard groups: connect to each group's ranks,
//! check they serve one model, warm each up (each group gets its own pool),
//! and start one batching loop per group behind one routing layer.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::mpsc;

use crate::batching::BatchingLoop;
use crate::client::{ShardAddr, ShardAuth, ShardedClient};
use crate::kv::KvManager;
use crate::kv_events::EventSink;
use crate::proto::pb;
use crate::routing::{GroupHandle, Placer, Routing};
use crate::scheduler::SchedulerConfig;
use crate::shared_state::RouterState;

pub struct Group {
    pub client: ShardedClient,
    pub info: pb::InfoResponse,
    pub warmup: pb::WarmupResponse,
}

/// Connects to and warms up every group, in order (on one host they share
/// the machine: warming up one at a time keeps each measurement honest).
pub async fn connect(
    groups: &[Vec<ShardAddr>],
    auth: &ShardAuth,
    warmup: &pb::WarmupRequest,
) -> Result<Vec<Group>, String> {
    let mut out: Vec<Group> = Vec::with_capacity(groups.len());
    for (i, paths) in groups.iter().enumerate() {
        let mut client = ShardedClient::connect(paths, auth, Duration::from_secs(600)).await?;
        let info = client.info().await.map_err(|e| format!("group {i}: shard Info failed: {}", e.message()))?;
        if let Some(first) = out.first() {
            let same = (&first.info.model_id, first.info.vocab_size, first.info.speculate, first.info.block_size)
                == (&info.model_id, info.vocab_size, info.speculate, info.block_size);
            if !same {
                return Err(format!(
                    "shard group {i} serves {} (vocab {}, speculate {}, block size {}), group 0 {} (vocab {}, speculate {}, block size {}): every group must serve the same model the same way",
                    info.model_id, info.vocab_size, info.speculate, info.block_size,
                    first.info.model_id, first.info.vocab_size, first.info.speculate, first.info.block_size
                ));
            }
        }
        tracing::info!("warming up shard group {i} ({} shard(s))", client.num_shards());
        let warm =
            client.warmup(*warmup).await.map_err(|e| format!("group {i}: shard Warmup failed: {}", e.message()))?;
        out.push(Group { client, info, warmup: warm });
    }
    Ok(out)
}

/// One loop per group behind one placer; returns the placer and the loops' tasks.
/// With `events`, each group's KV-cache events are published through it.
pub fn start(
    groups: &[Group],
    config: SchedulerConfig,
    (prefix_caching, routing): (bool, Routing),
    warmup: &pb::WarmupRequest,
    state: &Arc<RouterState>,
    events: Option<EventSink>,
) -> (Arc<Placer>, Vec<tokio::task::JoinHandle<()>>) {
    let mut handles = Vec::with_capacity(groups.len());
    let mut receivers = Vec::with_capacity(groups.len());
    for (i, g) in groups.iter().enumerate() {
        let (tx, rx) = mpsc::unbounded_channel();
        let mut kv = KvManager::for_warmup(&g.warmup, prefix_caching);
        if events.is_some() {
            kv = kv.with_events();
        }
        let stats = state.groups[i].clone();
        RouterState::set(&stats.kv_blocks_total, kv.capacity() as u64);
        RouterState::set(&stats.kv_blocks_free, kv.capacity() as u64);
        handles.push(GroupHandle { tx, kv: Arc::new(Mutex::new(kv)), stats });
        receivers.push(rx);
    }
    let placer = Arc::new(Placer::new(handles, routing));
    let tasks = receivers
        .into_iter()
        .enumerate()
        .map(|(i, rx)| {
            let s = BatchingLoop::new(groups[i].client.clone(), config, rx, placer.clone(), i, state.clone(), *warmup);
            let s = match &events {
                Some(sink) => s.with_events(sink.clone()),
                None => s,
            };
            tokio::spawn(s.run())
        })
        .collect();
    (placer, tasks)
}
