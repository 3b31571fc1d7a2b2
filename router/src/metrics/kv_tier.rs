//! /metrics lines of the second KV tier (docs/kv_cache.md): what it holds,
//! hits and misses, blocks and bytes moved each way, and load time against
//! the prefill time the loads saved.

use std::sync::atomic::AtomicU64;

use crate::shared_state::RouterState;

/// (name, help, value) of one series.
type Series = (&'static str, &'static str, f64);

fn get(v: &AtomicU64) -> f64 {
    RouterState::get(v) as f64
}

pub fn gauges(st: &RouterState) -> [Series; 2] {
    let bytes = get(&st.kv_tier_block_bytes);
    [
        ("pagemill_kv_tier_blocks", "KV blocks held by the second tier", get(&st.kv_tier_blocks)),
        ("pagemill_kv_tier_bytes", "Bytes held by the second tier", get(&st.kv_tier_blocks) * bytes),
    ]
}

pub fn counters(st: &RouterState) -> [Series; 13] {
    let bytes = get(&st.kv_tier_block_bytes);
    [
        (
            "pagemill_kv_tier_hit_blocks_total",
            "Prompt blocks past the prefix cache found in the second tier",
            get(&st.kv_tier_hit_blocks_total),
        ),
        (
            "pagemill_kv_tier_miss_blocks_total",
            "Prompt blocks past the prefix cache not in the second tier",
            get(&st.kv_tier_miss_blocks_total),
        ),
        (
            "pagemill_kv_tier_skipped_blocks_total",
            "Second-tier hits recomputed because recomputing was measured cheaper than loading",
            get(&st.kv_tier_skipped_blocks_total),
        ),
        (
            "pagemill_kv_tier_hit_tokens_total",
            "Prompt tokens planned to load from the second tier",
            get(&st.kv_tier_hit_tokens_total),
        ),
        (
            "pagemill_kv_tier_saved_blocks_total",
            "KV blocks copied from the pool to the second tier",
            get(&st.kv_tier_saved_blocks_total),
        ),
        (
            "pagemill_kv_tier_saved_bytes_total",
            "Bytes copied from the pool to the second tier",
            get(&st.kv_tier_saved_blocks_total) * bytes,
        ),
        (
            "pagemill_kv_tier_loaded_blocks_total",
            "KV blocks loaded from the second tier into the pool",
            get(&st.kv_tier_loaded_blocks_total),
        ),
        (
            "pagemill_kv_tier_loaded_bytes_total",
            "Bytes loaded from the second tier into the pool",
            get(&st.kv_tier_loaded_blocks_total) * bytes,
        ),
        (
            "pagemill_kv_tier_failed_loads_total",
            "Second-tier loads that failed (missing, corrupt or mismatched file); recomputed",
            get(&st.kv_tier_failed_loads_total),
        ),
        (
            "pagemill_kv_tier_lost_total",
            "Keys the shard's store reported lost (failed save, corrupt file)",
            get(&st.kv_tier_lost_total),
        ),
        (
            "pagemill_kv_tier_load_seconds_total",
            "Shard time spent loading second-tier blocks",
            get(&st.kv_tier_load_ns_total) / 1e9,
        ),
        (
            "pagemill_kv_tier_save_seconds_total",
            "Shard time spent copying blocks out to the second tier",
            get(&st.kv_tier_save_ns_total) / 1e9,
        ),
        (
            "pagemill_kv_tier_recompute_saved_seconds_total",
            "Prefill time the loaded blocks would have cost, at the rate measured at warmup",
            get(&st.kv_tier_recompute_saved_ns_total) / 1e9,
        ),
    ]
}
