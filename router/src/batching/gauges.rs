//! The figures a batching loop publishes into `RouterState`: its group's
//! gauges after each step, the router-wide sums over the groups, and the
//! second tier's counters of each reply.

use std::collections::BTreeSet;

use super::run::BatchingLoop;
use crate::kv::KvEvent;
use crate::proto::pb;
use crate::scheduler::Sequence;
use crate::shared_state::{GroupStats, RouterState};

impl BatchingLoop {
    /// Second-tier counters of one step reply; the load time is set against
    /// the prefill time the loaded blocks would have cost at the measured rate.
    pub(super) fn count_tier(&self, resp: &pb::StepResponse, loaded: u64, failed: u64) {
        let st = &self.router;
        RouterState::add(&st.kv_tier_loaded_blocks_total, loaded);
        RouterState::add(&st.kv_tier_failed_loads_total, failed);
        RouterState::add(&st.kv_tier_load_ns_total, resp.kv_load_ns);
        RouterState::add(&st.kv_tier_save_ns_total, resp.kv_save_ns);
        RouterState::add(&st.kv_tier_lost_total, resp.kv_lost.len() as u64);
        if let Some(costs) = self.state.kv.tier_costs() {
            let saved = loaded as f64 * costs.recompute_s(self.state.kv.block_size()) * 1e9;
            if saved.is_finite() {
                RouterState::add(&st.kv_tier_recompute_saved_ns_total, saved as u64);
            }
        }
    }

    /// KV-cache events to the publisher (none without `--kv-events-config`).
    pub(super) fn send_events(&self, events: Vec<KvEvent>) {
        if let Some(sink) = &self.events {
            sink.send(self.index, events);
        }
    }

    /// This group's gauges, then the router's: their sums over the groups;
    /// and the KV-cache events of what the last plan and reply changed.
    pub(super) fn publish(&self) {
        self.send_events(self.state.kv.take_events());
        let g = &self.stats;
        let kv = self.state.kv.stats();
        RouterState::set(&g.queue_size, self.state.queue.len() as u64);
        *g.queue_by_priority.lock().unwrap_or_else(|e| e.into_inner()) = self.state.queue_by_priority();
        RouterState::set(&g.batch_size, self.state.running.len() as u64);
        RouterState::set(&g.kv_blocks_total, kv.capacity as u64);
        RouterState::set(&g.kv_blocks_free, (kv.free + kv.cached_unused) as u64);
        RouterState::set(&g.kv_blocks_cached, kv.cached as u64);
        RouterState::set(&g.kv_utilization_ppm, self.state.kv_utilization_ppm());
        let queued: u64 = self.state.queue.iter().map(|s| s.tokens.len() as u64).sum();
        let running: u64 = self.state.running.iter().map(|s| s.tokens.len() as u64).sum();
        RouterState::set(&g.queued_tokens, queued);
        RouterState::set(&g.running_tokens, running);
        *g.lora_running.lock().unwrap_or_else(|e| e.into_inner()) = adapter_names(self.state.running.iter());
        *g.lora_waiting.lock().unwrap_or_else(|e| e.into_inner()) = adapter_names(self.state.queue.iter());
        publish_totals(&self.router, g);
        // The second tier's gauges are the router's (one tier per directory, not per group).
        if let Some(t) = self.state.kv.tier_stats() {
            let st = &self.router;
            RouterState::set(&st.kv_tier_blocks, t.stored);
            RouterState::set(&st.kv_tier_block_bytes, t.block_bytes);
            RouterState::set(&st.kv_tier_hit_blocks_total, t.hit_blocks);
            RouterState::set(&st.kv_tier_miss_blocks_total, t.miss_blocks);
            RouterState::set(&st.kv_tier_skipped_blocks_total, t.skipped_blocks);
            RouterState::set(&st.kv_tier_saved_blocks_total, t.saved_blocks);
        }
    }
}

/// The router-wide gauges from the groups' (from `only` where the router
/// has no group list: unit tests).
fn publish_totals(st: &RouterState, only: &GroupStats) {
    let one = [only];
    let groups: Vec<&GroupStats> =
        if st.groups.is_empty() { one.to_vec() } else { st.groups.iter().map(|g| &**g).collect() };
    let sum = |f: fn(&GroupStats) -> &std::sync::atomic::AtomicU64| {
        groups.iter().map(|g| RouterState::get(f(g))).sum::<u64>()
    };
    RouterState::set(&st.queue_size, sum(|g| &g.queue_size));
    RouterState::set(&st.batch_size, sum(|g| &g.batch_size));
    RouterState::set(&st.kv_blocks_total, sum(|g| &g.kv_blocks_total));
    RouterState::set(&st.kv_blocks_free, sum(|g| &g.kv_blocks_free));
    RouterState::set(&st.kv_blocks_cached, sum(|g| &g.kv_blocks_cached));
    RouterState::set(&st.kv_utilization_ppm, sum(|g| &g.kv_utilization_ppm) / groups.len() as u64);
    let mut by: std::collections::BTreeMap<i32, u64> = Default::default();
    for g in &groups {
        for (p, n) in g.queue_by_priority.lock().unwrap_or_else(|e| e.into_inner()).iter() {
            *by.entry(*p).or_default() += n;
        }
    }
    *st.queue_by_priority.lock().unwrap_or_else(|e| e.into_inner()) = by.into_iter().collect();
    let union = |f: fn(&GroupStats) -> &std::sync::Mutex<Vec<String>>| {
        let mut names: Vec<String> =
            groups.iter().flat_map(|g| f(g).lock().unwrap_or_else(|e| e.into_inner()).clone()).collect();
        names.sort();
        names.dedup();
        names
    };
    *st.lora_running.lock().unwrap_or_else(|e| e.into_inner()) = union(|g| &g.lora_running);
    *st.lora_waiting.lock().unwrap_or_else(|e| e.into_inner()) = union(|g| &g.lora_waiting);
}

/// The distinct adapter names of `seqs`, sorted.
fn adapter_names<'a>(seqs: impl Iterator<Item = &'a Sequence>) -> Vec<String> {
    let names: BTreeSet<&str> = seqs.filter_map(|s| s.adapter()).map(|a| a.name.as_str()).collect();
    names.into_iter().map(str::to_string).collect()
}
