//! Continuous batching: one task owns the queue, the running sequences, the
//! KV cache and the shard client. Between decode steps it admits queued
//! requests (one prefill), then advances everything running by one token,
//! preempting the newest sequences when the pool runs out. With chunked
//! prefill a long prompt is spread over several steps (`chunked.rs`).

pub mod admission;
mod chunked;
mod preempt;
mod sequence;

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Arc;
use std::time::Instant;

use rand::Rng;
use tokenizers::Tokenizer;
use tokio::sync::mpsc;

use crate::client::ShardedClient;
use crate::error::RouterError;
use crate::kv::KvManager;
use crate::proto::pb;
use crate::queue::Entry;
use crate::state::RouterState;
use admission::{admit, admit_chunked, Admission, Budget, Candidate, Running};
use chunked::{intermediate_chunk, Partial};
use sequence::{Outcome, Sequence, TextContext};

/// Order in which queued requests are considered for admission.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AdmissionOrder {
    /// Arrival order.
    Fifo,
    /// Longest cached prefix first (SGLang's LPM): more prefix hits while the
    /// shared blocks are still cached, at some cost in fairness.
    LongestPrefix,
}

pub struct SchedulerConfig {
    pub budget: Budget,
    /// Proposals per decode step; each step writes speculate + 1 slots.
    pub speculate: u32,
    pub order: AdmissionOrder,
}

pub struct Scheduler {
    client: ShardedClient,
    kv: KvManager,
    tokenizer: Arc<Tokenizer>,
    special_ids: HashSet<u32>,
    config: SchedulerConfig,
    rx: mpsc::UnboundedReceiver<Entry>,
    queue: VecDeque<Sequence>,
    running: HashMap<u64, Sequence>,
    /// The prompt being prefilled in chunks, if any (at most one: it is always
    /// the last admitted of a step, and continues first in the next).
    partial: Option<Partial>,
    /// Shard-side batches in the order the shard concatenates them.
    batches: Vec<pb::CachedBatch>,
    next_batch_id: u64,
    admissions: u64,
    state: Arc<RouterState>,
}

/// A sequence about to be prefilled, with the prompt tokens already in its blocks.
struct Admitted {
    seq: Sequence,
    cache_len: u32,
    /// Tokens with KV after this step: the whole sequence, or the end of a chunk.
    end: u32,
    /// Tokens of cache_len that came from the prefix cache (metrics).
    hit: u32,
}

impl Scheduler {
    pub fn new(
        client: ShardedClient,
        kv: KvManager,
        tokenizer: Arc<Tokenizer>,
        config: SchedulerConfig,
        rx: mpsc::UnboundedReceiver<Entry>,
        state: Arc<RouterState>,
    ) -> Self {
        let special_ids = tokenizer
            .get_added_tokens_decoder()
            .iter()
            .filter(|(_, t)| t.special)
            .map(|(&id, _)| id)
            .collect();
        Self {
            client,
            kv,
            tokenizer,
            special_ids,
            config,
            rx,
            queue: VecDeque::new(),
            running: HashMap::new(),
            partial: None,
            batches: Vec::new(),
            next_batch_id: 0,
            admissions: 0,
            state,
        }
    }

    fn enqueue(&mut self, entry: Entry) {
        let seed = if entry.request.parameters.do_sample {
            Some(entry.request.seed.unwrap_or_else(|| rand::rng().random()))
        } else {
            entry.request.seed
        };
        self.queue.push_back(Sequence::new(entry, seed));
    }

    pub async fn run(mut self) {
        loop {
            if self.running.is_empty() && self.queue.is_empty() && self.partial.is_none() {
                match self.rx.recv().await {
                    Some(e) => self.enqueue(e),
                    None => break,
                }
            }
            while let Ok(e) = self.rx.try_recv() {
                self.enqueue(e);
            }
            self.drop_leaving_entries();
            if let Err(err) = self.step().await {
                self.fail_all(err).await;
            }
            self.publish();
        }
    }

    /// Cancelled and queue-timed-out entries leave before admission (they
    /// never held blocks). `/info` shows them gone before a timed-out client
    /// hears why, so a client that asks next sees the queue it left.
    fn drop_leaving_entries(&mut self) {
        let now = Instant::now();
        // Runs every step: nothing is moved unless someone leaves.
        if self.queue.iter().all(|s| s.entry.still_waiting(now, s.preemptions > 0)) {
            return;
        }
        let (waiting, leaving): (VecDeque<_>, VecDeque<_>) =
            self.queue.drain(..).partition(|s| s.entry.still_waiting(now, s.preemptions > 0));
        self.queue = waiting;
        self.publish();
        for s in leaving.iter().filter(|s| s.entry.overdue(now, s.preemptions > 0)) {
            s.entry.answer_queue_timeout(now);
        }
    }

    async fn step(&mut self) -> Result<(), RouterError> {
        self.drop_cancelled().await?;
        let admitted = self.next_prefill();
        if !admitted.is_empty() {
            self.prefill(admitted).await?;
        }
        if !self.running.is_empty() {
            self.decode().await?;
        }
        Ok(())
    }

    /// Groups the queue into admission units: a request, or all forks of one
    /// `n`/`best_of` request (they arrive together and go together).
    fn units(&self) -> Vec<std::ops::Range<usize>> {
        let mut units = Vec::new();
        let mut start = 0;
        while start < self.queue.len() {
            let group = self.queue[start].entry.group;
            let mut end = start + 1;
            while group.is_some() && end < self.queue.len() && self.queue[end].entry.group == group {
                end += 1;
            }
            units.push(start..end);
            start = end;
        }
        units
    }

    fn candidate(&self, unit: &std::ops::Range<usize>) -> Candidate {
        let bs = self.kv.block_size();
        let leader = &self.queue[unit.start];
        let len = leader.tokens.len() as u32;
        let blocks = self.kv.blocks_for(len);
        let cached = self.kv.peek_prefix(&leader.tokens).min(blocks);
        let forks = unit.len() as u32 - 1;
        let shared = fork_shared_blocks(len, bs);
        Candidate {
            // Prompt logprobs are reported by one prefill; forks share
            // blocks their leader writes in the same step.
            chunkable: self.config.budget.prefill_chunk_tokens.is_some()
                && forks == 0
                && !leader.entry.request.decoder_input_details,
            sequences: unit.len() as u32,
            prefill_tokens: (len - cached * bs) + forks * (len - shared * bs),
            tokens: len as u64 * unit.len() as u64,
            // Taking a cached prefix can use up reclaimable blocks too, so the
            // cached part counts against availability as well.
            new_blocks: blocks + forks * (blocks - shared),
        }
    }

    /// Takes from the queue what fits, with blocks for each prompt; with
    /// chunked prefill, the next chunk of a partial prompt comes first.
    fn next_prefill(&mut self) -> Vec<Admitted> {
        let mut admitted: Vec<Admitted> = Vec::new();
        let chunk = self.config.budget.prefill_chunk_tokens;
        let mut step_tokens = chunk.unwrap_or(0);
        let mut running = Running {
            sequences: self.running.len() as u32,
            tokens: self.running.values().map(|s| s.tokens.len() as u64).sum(),
            available_blocks: self.kv.available(),
        };
        if let Some(Partial { seq, done }) = self.partial.take() {
            let len = seq.tokens.len() as u32;
            let end = (done + step_tokens).min(len);
            step_tokens -= end - done;
            running.sequences += 1;
            running.tokens += len as u64;
            admitted.push(Admitted { seq, cache_len: done, end, hit: 0 });
            if end < len || step_tokens == 0 {
                return admitted;
            }
        }
        if self.queue.is_empty() {
            return admitted;
        }
        if self.config.order == AdmissionOrder::LongestPrefix {
            self.sort_queue_by_cached_prefix();
        }
        let units = self.units();
        let candidates: Vec<Candidate> = units.iter().map(|u| self.candidate(u)).collect();
        let budget = self.growth_budget();
        let Admission { whole: n, partial } = match chunk {
            Some(_) => admit_chunked(&budget, running, &candidates, step_tokens),
            None => Admission { whole: admit(&budget, running, &candidates), partial: None },
        };
        let take = if n == 0 { 0 } else { units[n - 1].end } + partial.is_some() as usize;
        let bs = self.kv.block_size();
        admitted.reserve(take);
        let mut taken: VecDeque<Sequence> = self.queue.drain(..take).collect();
        while let Some(mut seq) = taken.pop_front() {
            let len = seq.tokens.len() as u32;
            let mut blocks = self.kv.acquire_prefix(&seq.tokens);
            // Prompts of this same prefill that share a longer prefix (forks of
            // `n`/`best_of`, a common system prompt arriving at once) share the
            // earlier one's blocks: the shard writes them before anyone reads.
            let limit = fork_shared_blocks(len, bs);
            let caching = self.kv.prefix_caching();
            let best = admitted
                .iter()
                // Without prefix caching only forks of one request share.
                .filter(|a| caching || (seq.entry.group.is_some() && a.seq.entry.group == seq.entry.group))
                .map(|a| (common_blocks(&a.seq.tokens, &seq.tokens, bs).min(limit), a))
                .max_by_key(|(m, _)| *m);
            if let Some((m, a)) = best {
                if m > blocks.len() {
                    blocks = a.seq.blocks.as_ref().expect("admitted").share_prefix(m);
                }
            }
            let cache_len = blocks.len() * bs;
            if !blocks.ensure_capacity(len) {
                // Admission estimates are conservative; should one still fall
                // short, the rest waits for the next step rather than failing.
                drop(blocks);
                taken.push_front(seq);
                while let Some(s) = taken.pop_back() {
                    self.queue.push_front(s);
                }
                break;
            }
            seq.blocks = Some(blocks);
            self.admissions += 1;
            seq.admitted_at = self.admissions;
            // The chunked candidate is the last one taken; it starts with
            // what is left of this step's budget.
            let end = match partial {
                Some(tokens) if taken.is_empty() => (cache_len + tokens).min(len),
                _ => len,
            };
            admitted.push(Admitted { seq, cache_len, end, hit: cache_len });
        }
        admitted
    }

    /// The budget with room for the running batch to grow: on top of the
    /// watermark, one block per running sequence, which is what the batch
    /// takes over the next `block_size` decode steps. Without it admission
    /// packs the pool to the brim and a newcomer is preempted (and its prompt
    /// recomputed) within a few steps, over and over.
    fn growth_budget(&self) -> Budget {
        let per_step = 1 + self.config.speculate;
        let growth = self.running.len() as u32 * per_step;
        let mut budget = self.config.budget;
        budget.watermark_blocks = budget.watermark_blocks.saturating_add(growth);
        budget
    }

    fn sort_queue_by_cached_prefix(&mut self) {
        let units = self.units();
        let mut keyed: Vec<(u32, Vec<Sequence>)> = Vec::with_capacity(units.len());
        let hits: Vec<u32> = units.iter().map(|u| self.kv.peek_prefix(&self.queue[u.start].tokens)).collect();
        let mut drained: VecDeque<Sequence> = self.queue.drain(..).collect();
        for (u, hit) in units.iter().zip(hits) {
            keyed.push((hit, drained.drain(..u.len()).collect()));
        }
        // Stable: equal hits keep arrival order.
        keyed.sort_by_key(|(hit, _)| std::cmp::Reverse(*hit));
        self.queue = keyed.into_iter().flat_map(|(_, seqs)| seqs).collect();
    }

    async fn prefill(&mut self, admitted: Vec<Admitted>) -> Result<(), RouterError> {
        let id = self.next_batch_id;
        self.next_batch_id += 1;
        let mut requests = Vec::with_capacity(admitted.len());
        let (mut computed, mut hits) = (0u64, 0u64);
        let mut chunk_end = None;
        for Admitted { mut seq, cache_len, end, hit } in admitted {
            let len = seq.tokens.len() as u32;
            computed += (end - cache_len) as u64;
            hits += hit as u64;
            if end < len {
                requests.push(intermediate_chunk(&seq, cache_len, end));
                // Held here while the shard computes, so that a failure reaches its client.
                self.partial = Some(Partial { seq, done: cache_len });
                chunk_end = Some(end);
                continue;
            }
            let blocks = seq.blocks.as_ref().expect("admitted sequence has blocks");
            let r = &seq.entry.request;
            let mut parameters = r.parameters.clone();
            if let Some(seed) = seq.seed {
                parameters.seed = seed;
                parameters.has_seed = true;
            }
            requests.push(pb::Request {
                id: seq.id(),
                input_ids: seq.tokens.clone(),
                cache_len,
                block_table: blocks.ids().to_vec(),
                slots: blocks.slots(cache_len, len),
                parameters: Some(parameters),
                stopping_parameters: Some(pb::StoppingCriteriaParameters {
                    max_new_tokens: seq.remaining_new_tokens(),
                    ignore_eos_token: r.ignore_eos,
                    min_new_tokens: r.min_new_tokens.saturating_sub(seq.generated_tokens),
                    stop_token_ids: r.stop_token_ids.clone(),
                }),
                top_n_tokens: r.top_n_tokens,
                // A resumed sequence already sent its prompt details.
                prefill_logprobs: r.decoder_input_details && seq.preemptions == 0,
                generated_len: seq.generated_tokens,
                grammar: r.grammar.clone(),
            });
            seq.seq_len = len;
            self.running.insert(seq.id(), seq);
        }
        let ids: Vec<u64> = requests.iter().map(|r| r.id).collect();
        let resp = self
            .client
            .prefill(pb::PrefillRequest {
                batch: Some(pb::Batch { id, requests }),
            })
            .await?;
        RouterState::add(&self.state.prefill_tokens_total, computed);
        RouterState::add(&self.state.prefix_hit_tokens_total, hits);
        if let (Some(p), Some(end)) = (self.partial.as_mut(), chunk_end) {
            // The shard keeps nothing of an intermediate chunk but its KV
            // (its one sampled token is dropped: the request is not running).
            p.done = end;
            let blocks = p.seq.blocks.as_ref().expect("a chunked sequence holds its prompt blocks");
            self.kv.commit(blocks, &p.seq.tokens[..end as usize]);
        }
        // The shard confirmed these prompts' KV: their full blocks may be shared now.
        for id in &ids {
            if let Some(s) = self.running.get(id) {
                let blocks = s.blocks.as_ref().expect("running sequence has blocks");
                self.kv.commit(blocks, &s.tokens[..s.seq_len as usize]);
            }
        }
        let ended = self.apply_generations(&resp.generations, true);
        if let Some(b) = resp.batch {
            self.batches.push(b);
        }
        self.filter(ended).await
    }

    async fn decode(&mut self) -> Result<(), RouterError> {
        let started = Instant::now();
        let preempted = self.grow_or_preempt();
        if !preempted.is_empty() {
            RouterState::add(&self.state.preemptions_total, preempted.len() as u64);
            let ids = preempted.iter().map(|s| s.id()).collect();
            // Oldest first at the head of the queue: they resume before new work.
            for s in preempted.into_iter().rev() {
                self.queue.push_front(s);
            }
            self.filter(ids).await?;
        }
        if self.running.is_empty() {
            return Ok(());
        }
        let mut slots = Vec::with_capacity(self.running.len());
        for b in &self.batches {
            for id in &b.request_ids {
                let s = &self.running[id];
                let blocks = s.blocks.as_ref().expect("running sequence has blocks");
                slots.push(pb::RequestSlots {
                    request_id: *id,
                    block_table: blocks.ids().to_vec(),
                    slots: blocks.slots(s.seq_len, s.seq_len + 1 + self.config.speculate),
                });
            }
        }
        let req = pb::DecodeRequest {
            batches: std::mem::take(&mut self.batches),
            slots,
        };
        let resp = self.client.decode(req).await?;
        // The KV of the fed token and of every accepted proposal is now valid:
        // one position per returned token. Slots written past that (rejected
        // proposals) are overwritten by later steps.
        for g in &resp.generations {
            if let Some(s) = self.running.get_mut(&g.request_id) {
                s.seq_len += g.tokens.as_ref().map_or(1, |t| t.ids.len() as u32);
            }
        }
        let ended = self.apply_generations(&resp.generations, false);
        if let Some(b) = resp.batch {
            self.batches.push(b);
        }
        RouterState::add(&self.state.decode_steps_total, 1);
        RouterState::add(&self.state.decode_forward_ns_total, resp.forward_ns);
        RouterState::add(&self.state.decode_step_ns_total, started.elapsed().as_nanos() as u64);
        self.filter(ended).await
    }

    /// Streams tokens to clients; returns the ids the router ended itself.
    fn apply_generations(&mut self, generations: &[pb::Generation], prefill: bool) -> Vec<u64> {
        let ctx = TextContext {
            tokenizer: &self.tokenizer,
            special_ids: &self.special_ids,
        };
        let mut ended = Vec::new();
        let mut finished = Vec::new();
        let mut generated = 0u64;
        for g in generations {
            let Some(seq) = self.running.get_mut(&g.request_id) else {
                continue;
            };
            if prefill && seq.entry.request.decoder_input_details && seq.preemptions == 0 {
                if let Some(t) = &g.prefill_tokens {
                    seq.send_prefill_tokens(&ctx, t);
                }
            }
            generated += g.tokens.as_ref().map_or(0, |t| t.ids.len() as u64);
            match seq.apply(&ctx, g) {
                Outcome::Running => {}
                Outcome::FinishedByShard | Outcome::Failed => finished.push(g.request_id),
                Outcome::EndedByRouter => ended.push(g.request_id),
            }
        }
        for id in finished.iter().chain(ended.iter()) {
            self.finish(*id);
        }
        RouterState::add(&self.state.generated_tokens_total, generated);
        ended
    }

    /// Removes a sequence, keeping its computed blocks in the prefix cache;
    /// dropping it releases its references.
    fn finish(&mut self, id: u64) {
        if let Some(s) = self.running.remove(&id) {
            if let Some(blocks) = &s.blocks {
                self.kv.commit(blocks, &s.tokens[..(s.seq_len as usize).min(s.tokens.len())]);
            }
        }
    }

    /// Tells the shards to forget requests the router ended.
    async fn filter(&mut self, ended: Vec<u64>) -> Result<(), RouterError> {
        if ended.is_empty() {
            return Ok(());
        }
        let mut kept = Vec::with_capacity(self.batches.len());
        for b in std::mem::take(&mut self.batches) {
            let keep: Vec<u64> = b.request_ids.iter().copied().filter(|id| self.running.contains_key(id)).collect();
            if keep.len() == b.request_ids.len() {
                kept.push(b);
            } else if keep.is_empty() {
                self.client.clear_cache(Some(b.id)).await?;
            } else {
                let resp = self
                    .client
                    .filter_batch(pb::FilterBatchRequest {
                        batch_id: b.id,
                        request_ids: keep,
                    })
                    .await?;
                kept.extend(resp.batch);
            }
        }
        self.batches = kept;
        Ok(())
    }

    /// Clients that went away free their blocks before the next step runs.
    async fn drop_cancelled(&mut self) -> Result<(), RouterError> {
        if self.partial.as_ref().is_some_and(|p| p.seq.entry.is_cancelled()) {
            // The shard holds nothing of it; its computed blocks stay cached.
            let p = self.partial.take().expect("checked");
            let blocks = p.seq.blocks.as_ref().expect("a chunked sequence holds its prompt blocks");
            self.kv.commit(blocks, &p.seq.tokens[..p.done as usize]);
        }
        let gone: Vec<u64> = self.running.values().filter(|s| s.entry.is_cancelled()).map(|s| s.id()).collect();
        if gone.is_empty() {
            return Ok(());
        }
        for id in &gone {
            self.finish(*id);
        }
        self.publish();
        self.filter(gone).await
    }

    /// A shard call failed: every running request gets the error, all state is dropped.
    async fn fail_all(&mut self, err: RouterError) {
        tracing::error!("shard call failed: {err}");
        self.state.healthy.store(false, std::sync::atomic::Ordering::Relaxed);
        let n = self.running.len() as u64;
        for (_, s) in self.running.drain() {
            s.fail(err.clone());
        }
        let n = n + self.partial.take().map(|p| p.seq.fail(err.clone())).is_some() as u64;
        RouterState::add(&self.state.requests_failed, n);
        self.batches.clear();
        // Best effort: a shard that is still alive should not keep stale batches.
        let _ = self.client.clear_cache(None).await;
    }

    fn publish(&self) {
        let st = &self.state;
        let kv = self.kv.stats();
        RouterState::set(&st.queue_size, self.queue.len() as u64);
        RouterState::set(&st.batch_size, self.running.len() as u64);
        RouterState::set(&st.kv_blocks_free, (kv.free + kv.cached_unused) as u64);
        RouterState::set(&st.kv_blocks_cached, kv.cached as u64);
        // Slots holding real tokens over slots allocated to running sequences.
        let held = kv.used() as u64 * self.kv.block_size() as u64;
        let real: u64 = self.running.values().map(|s| s.seq_len as u64).sum();
        let ppm = if held == 0 { 0 } else { (real.min(held) * 1_000_000) / held };
        RouterState::set(&st.kv_utilization_ppm, ppm);
    }
}

/// Full prompt blocks a fork shares with its leader: at least one token is
/// left for the fork to compute, since its first token is sampled from it.
fn fork_shared_blocks(len: u32, block_size: u32) -> u32 {
    len.saturating_sub(1) / block_size
}

/// Number of leading full blocks two token sequences have in common.
fn common_blocks(a: &[u32], b: &[u32], block_size: u32) -> u32 {
    let same = a.iter().zip(b).take_while(|(x, y)| x == y).count() as u32;
    same / block_size
}
