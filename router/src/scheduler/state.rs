//! Everything the scheduler decides over: the queue, the running sequences
//! (in admission order), the KV cache, and what the shard must forget at
//! the next step. Changed only by `schedule`, `update` and the small
//! operations here, none of which does I/O.

use std::collections::VecDeque;
use std::time::Instant;

use super::logprob_cache::LogprobCache;
use super::sequence::Sequence;
use super::SchedulerConfig;
use crate::kv::KvManager;
use crate::queue::Entry;

pub struct State {
    pub config: SchedulerConfig,
    pub kv: KvManager,
    /// Prompt logprobs stored beside the prefix cache's blocks.
    pub logprob_cache: LogprobCache,
    pub queue: VecDeque<Sequence>,
    /// Oldest admission first.
    pub running: Vec<Sequence>,
    /// Ids the shard still holds that the router ended since the last step.
    pub finished: Vec<u64>,
    pub admissions: u64,
    pub arrivals: u64,
    /// Without mixed steps, prefill and decode steps alternate.
    pub last_was_prefill: bool,
}

impl State {
    pub fn new(config: SchedulerConfig, kv: KvManager) -> Self {
        Self {
            config,
            logprob_cache: LogprobCache::new(kv.block_size(), kv.capacity()),
            kv,
            queue: VecDeque::new(),
            running: Vec::new(),
            finished: Vec::new(),
            admissions: 0,
            arrivals: 0,
            last_was_prefill: false,
        }
    }

    pub fn enqueue(&mut self, entry: Entry) {
        let mut s = Sequence::new(entry);
        self.arrivals += 1;
        s.arrival = self.arrivals;
        self.queue.push_back(s);
    }

    /// A sequence moved here from a failed group: it waits in the queue
    /// like a preempted one (it keeps its tokens, so it resumes by recompute).
    pub fn resume(&mut self, mut s: Sequence) {
        self.arrivals += 1;
        s.arrival = self.arrivals;
        self.queue.push_back(s);
    }

    /// The group's shards are gone: every sequence leaves, running ones
    /// reset as by preemption (their KV died with the shard, so nothing goes
    /// to the prefix cache), queued ones as they are. Nothing is left for
    /// the shard to forget.
    pub fn evacuate(&mut self) -> Vec<Sequence> {
        let running = std::mem::take(&mut self.running);
        let mut out: Vec<Sequence> = running
            .into_iter()
            .map(|s| {
                let mut s = self.release(s, false);
                s.lost = s.num_computed;
                s.preemptions += 1;
                s.num_computed = 0;
                s.sent_blocks = 0;
                s.prefilled = false;
                s
            })
            .collect();
        out.extend(self.queue.drain(..));
        self.finished.clear();
        out.sort_by_key(|s| s.arrival);
        out
    }

    pub fn is_idle(&self) -> bool {
        self.queue.is_empty() && self.running.is_empty()
    }

    pub fn running_index(&self, id: u64) -> Option<usize> {
        self.running.iter().position(|s| s.id == id)
    }

    /// Ends a sequence wherever it is (client gone, stop sequence matched):
    /// its computed blocks stay in the prefix cache, the shard is told to
    /// forget it. False when the id is unknown.
    pub fn abort(&mut self, id: u64) -> bool {
        if let Some(i) = self.queue.iter().position(|s| s.id == id) {
            self.queue.remove(i);
            return true;
        }
        match self.running_index(id) {
            Some(i) => {
                let s = self.running.remove(i);
                self.release(s, true);
                true
            }
            None => false,
        }
    }

    /// Takes a running sequence out: its computed full blocks go to the
    /// prefix cache (when `cache`), dropping the table releases the rest.
    pub fn release(&mut self, s: Sequence, cache: bool) -> Sequence {
        let mut s = s;
        if let Some(blocks) = s.blocks.take() {
            if cache {
                let computed = (s.num_computed as usize).min(s.tokens.len());
                self.kv.commit(s.adapter(), &blocks, &s.tokens[..computed]);
            }
        }
        if s.on_shard {
            self.finished.push(s.id);
        }
        s.on_shard = false;
        s
    }

    /// Queued sequences past their deadline leave (they never held blocks).
    pub fn take_overdue(&mut self, now: Instant) -> Vec<Sequence> {
        if !self.queue.iter().any(|s| s.overdue(now)) {
            return Vec::new();
        }
        let (late, waiting): (VecDeque<_>, VecDeque<_>) = self.queue.drain(..).partition(|s| s.overdue(now));
        self.queue = waiting;
        late.into_iter().collect()
    }

    /// The shard call failed: every running sequence ends; the ids are
    /// returned for their streams to get the error.
    pub fn fail_running(&mut self) -> Vec<u64> {
        let running = std::mem::take(&mut self.running);
        running.into_iter().map(|s| self.release(s, false).id).collect()
    }

    /// Queued sequences per priority value, ascending.
    pub fn queue_by_priority(&self) -> Vec<(i32, u64)> {
        let mut by: std::collections::BTreeMap<i32, u64> = std::collections::BTreeMap::new();
        for s in &self.queue {
            *by.entry(s.priority()).or_default() += 1;
        }
        by.into_iter().collect()
    }

    /// Tokens with KV held by running sequences over slots allocated to
    /// them, in parts per million.
    pub fn kv_utilization_ppm(&self) -> u64 {
        let held = self.kv.stats().used() as u64 * self.kv.block_size() as u64;
        let real: u64 = self.running.iter().map(|s| s.num_computed as u64).sum();
        if held == 0 {
            0
        } else {
            (real.min(held) * 1_000_000) / held
        }
    }
}
