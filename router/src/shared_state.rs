//! The router's shared figures and health flags: counters and gauges the batching
//! loops write and the HTTP side reads (`/metrics`, `/info`, `/health`), plus the
//! drain and liveness flags. One `RouterState` per router (and per unit test).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

#[derive(Debug, Default)]
pub struct RouterState {
    pub healthy: AtomicBool,
    /// True while the batching loop runs; it clears it when it ends or
    /// panics, and `/health` answers 503 from then on.
    pub scheduler_alive: AtomicBool,
    /// Set on SIGTERM: generation routes answer 503 `shutting_down` and
    /// `/health` 503 while accepted requests finish.
    pub draining: AtomicBool,
    pub queue_size: AtomicU64,
    pub batch_size: AtomicU64,
    pub kv_blocks_total: AtomicU64,
    pub kv_blocks_free: AtomicU64,
    pub kv_block_size: AtomicU64,
    pub requests_total: AtomicU64,
    pub requests_failed: AtomicU64,
    pub prefill_tokens_total: AtomicU64,
    pub generated_tokens_total: AtomicU64,
    pub decode_steps_total: AtomicU64,
    /// Steps sent before the reply of the step ahead of them (scheduler/ahead.rs).
    pub steps_ahead_total: AtomicU64,
    /// Sum over decode steps of the shard's forward time and of the whole step, in ns.
    pub decode_forward_ns_total: AtomicU64,
    pub decode_step_ns_total: AtomicU64,
    pub kv_blocks_cached: AtomicU64,
    pub prefix_hit_tokens_total: AtomicU64,
    pub preemptions_total: AtomicU64,
    /// Requests refused because they can never fit the KV pool or a batch.
    pub requests_too_large_total: AtomicU64,
    /// Sequences moved to another shard group when theirs failed.
    pub requeued_total: AtomicU64,
    /// Tokens computed again because preemption dropped their KV.
    pub recomputed_tokens_total: AtomicU64,
    /// Queued requests per `priority` value, ascending (empty levels left out).
    pub queue_by_priority: std::sync::Mutex<Vec<(i32, u64)>>,
    /// Blocks running sequences gave back behind a sliding window.
    pub kv_window_released_blocks_total: AtomicU64,
    /// KV utilization of running sequences, parts per million.
    pub kv_utilization_ppm: AtomicU64,
    /// Second KV tier (all zero without one): blocks it holds, bytes per
    /// block, and cumulative counts (hits/misses/skips are prompt blocks
    /// looked up past the prefix cache; saved/loaded are blocks copied).
    pub kv_tier_blocks: AtomicU64,
    pub kv_tier_block_bytes: AtomicU64,
    pub kv_tier_hit_blocks_total: AtomicU64,
    pub kv_tier_miss_blocks_total: AtomicU64,
    pub kv_tier_skipped_blocks_total: AtomicU64,
    pub kv_tier_saved_blocks_total: AtomicU64,
    pub kv_tier_loaded_blocks_total: AtomicU64,
    pub kv_tier_failed_loads_total: AtomicU64,
    pub kv_tier_lost_total: AtomicU64,
    pub kv_tier_hit_tokens_total: AtomicU64,
    pub kv_tier_load_ns_total: AtomicU64,
    pub kv_tier_save_ns_total: AtomicU64,
    /// Prefill time the loaded blocks would have cost at the measured rate.
    pub kv_tier_recompute_saved_ns_total: AtomicU64,
    /// Latency histograms and per-route counters, written by the HTTP side.
    pub metrics: crate::metrics::Metrics,
    /// One entry per data-parallel shard group (`--data-parallel`); the
    /// gauges above are their sums, the counters their totals.
    pub groups: Vec<std::sync::Arc<GroupStats>>,
    /// LoRA adapters by name: those with sequences running, and those with
    /// sequences waiting, over every group (sorted).
    pub lora_running: std::sync::Mutex<Vec<String>>,
    pub lora_waiting: std::sync::Mutex<Vec<String>>,
    /// Requests accepted per adapter name.
    pub lora_requests: std::sync::Mutex<std::collections::BTreeMap<String, u64>>,
}

/// One shard group's live figures, written by its batching loop (and the
/// routing layer for `pending_tokens` / `placed_total`), read by
/// routing, `/info` and `/metrics`.
#[derive(Debug, Default)]
pub struct GroupStats {
    /// In rotation: its loop runs and its last step answered.
    pub serving: AtomicBool,
    /// Prompt tokens placed on the group that its loop has not taken yet:
    /// load the queue gauges cannot show until the next iteration.
    pub pending_tokens: AtomicU64,
    /// Prompt tokens still to compute of the group's queued requests.
    pub queued_tokens: AtomicU64,
    /// Tokens (prompt + generated) of its running sequences.
    pub running_tokens: AtomicU64,
    pub queue_size: AtomicU64,
    pub batch_size: AtomicU64,
    pub kv_blocks_total: AtomicU64,
    /// Free plus cached-but-unused (evictable) blocks.
    pub kv_blocks_free: AtomicU64,
    pub kv_blocks_cached: AtomicU64,
    pub kv_utilization_ppm: AtomicU64,
    pub queue_by_priority: std::sync::Mutex<Vec<(i32, u64)>>,
    pub placed_total: AtomicU64,
    pub prefill_tokens_total: AtomicU64,
    pub prefix_hit_tokens_total: AtomicU64,
    pub generated_tokens_total: AtomicU64,
    /// Names of the adapters this group's running / queued sequences use (sorted).
    pub lora_running: std::sync::Mutex<Vec<String>>,
    pub lora_waiting: std::sync::Mutex<Vec<String>>,
}

impl GroupStats {
    pub fn serving(&self) -> bool {
        self.serving.load(Ordering::SeqCst)
    }
}

impl RouterState {
    /// A state with `n` shard groups, all serving.
    pub fn with_groups(n: usize) -> Self {
        let groups = (0..n)
            .map(|_| {
                let g = GroupStats::default();
                g.serving.store(true, Ordering::SeqCst);
                std::sync::Arc::new(g)
            })
            .collect();
        Self { groups, ..Default::default() }
    }

    pub fn get(v: &AtomicU64) -> u64 {
        v.load(Ordering::Relaxed)
    }

    pub fn set(v: &AtomicU64, x: u64) {
        v.store(x, Ordering::Relaxed)
    }

    pub fn add(v: &AtomicU64, x: u64) {
        v.fetch_add(x, Ordering::Relaxed);
    }
}
