//! Continuous batching: one task owns the queue, the running sequences, the
//! KV allocator and the shard client. Between decode steps it admits new
//! requests (a prefill), then advances everything running by one token.

pub mod admission;
mod sequence;

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Arc;
use std::time::Instant;

use rand::Rng;
use tokenizers::Tokenizer;
use tokio::sync::mpsc;

use crate::client::ShardedClient;
use crate::error::RouterError;
use crate::kv::BlockAllocator;
use crate::proto::pb;
use crate::queue::Entry;
use crate::state::RouterState;
use admission::{admit, Budget, Candidate, Reservation};
use sequence::{Outcome, Sequence, TextContext};

pub struct Scheduler {
    client: ShardedClient,
    allocator: BlockAllocator,
    tokenizer: Arc<Tokenizer>,
    special_ids: HashSet<u32>,
    budget: Budget,
    rx: mpsc::UnboundedReceiver<Entry>,
    queue: VecDeque<Entry>,
    running: HashMap<u64, Sequence>,
    /// Shard-side batches in the order the shard concatenates them.
    batches: Vec<pb::CachedBatch>,
    reserved: Reservation,
    /// Proposals per decode step; each step writes speculate + 1 slots.
    speculate: u32,
    next_batch_id: u64,
    state: Arc<RouterState>,
}

impl Scheduler {
    pub fn new(
        client: ShardedClient,
        allocator: BlockAllocator,
        tokenizer: Arc<Tokenizer>,
        budget: Budget,
        speculate: u32,
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
            allocator,
            tokenizer,
            special_ids,
            budget,
            rx,
            queue: VecDeque::new(),
            running: HashMap::new(),
            batches: Vec::new(),
            reserved: Reservation::default(),
            speculate,
            next_batch_id: 0,
            state,
        }
    }

    pub async fn run(mut self) {
        loop {
            if self.running.is_empty() && self.queue.is_empty() {
                match self.rx.recv().await {
                    Some(e) => self.queue.push_back(e),
                    None => break,
                }
            }
            while let Ok(e) = self.rx.try_recv() {
                self.queue.push_back(e);
            }
            self.queue.retain(|e| !e.is_cancelled());
            let step = self.step().await;
            if let Err(err) = step {
                self.fail_all(err).await;
            }
            self.publish();
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

    /// Takes from the queue what fits, with blocks for each prompt.
    fn next_prefill(&mut self) -> Vec<Sequence> {
        let candidates: Vec<Candidate> = self
            .queue
            .iter()
            .map(|e| {
                let input_len = e.request.input_ids.len() as u32;
                Candidate {
                    prefill_tokens: input_len,
                    // Speculation writes up to `speculate` slots past the last token.
                    reservation: Reservation::of(&self.budget, input_len, e.request.max_new_tokens + self.speculate),
                }
            })
            .collect();
        let n = admit(&self.budget, self.running.len() as u32, self.reserved, &candidates);
        let mut admitted = Vec::with_capacity(n);
        for c in candidates.into_iter().take(n) {
            let entry = self.queue.pop_front().expect("admitted entry is queued");
            let input_len = entry.request.input_ids.len() as u32;
            // Reservations guarantee the pool holds every admitted worst case.
            let blocks = self
                .allocator
                .allocate(self.allocator.blocks_for(input_len))
                .expect("reserved blocks are free");
            let seed = if entry.request.parameters.do_sample {
                Some(entry.request.seed.unwrap_or_else(|| rand::rng().random()))
            } else {
                entry.request.seed
            };
            self.reserved.add(c.reservation);
            admitted.push(Sequence::new(entry, blocks, c.reservation, seed));
        }
        admitted
    }

    async fn prefill(&mut self, seqs: Vec<Sequence>) -> Result<(), RouterError> {
        let id = self.next_batch_id;
        self.next_batch_id += 1;
        let requests = seqs
            .iter()
            .map(|s| {
                let r = &s.entry.request;
                let len = r.input_ids.len() as u32;
                let mut parameters = r.parameters;
                if let Some(seed) = s.seed {
                    parameters.seed = seed;
                    parameters.has_seed = true;
                }
                pb::Request {
                    id: s.id(),
                    input_ids: r.input_ids.clone(),
                    cache_len: 0,
                    block_table: s.blocks.ids().to_vec(),
                    slots: s.blocks.slots(0, len),
                    parameters: Some(parameters),
                    stopping_parameters: Some(pb::StoppingCriteriaParameters {
                        max_new_tokens: r.max_new_tokens,
                        ignore_eos_token: r.ignore_eos,
                    }),
                    top_n_tokens: r.top_n_tokens,
                    prefill_logprobs: r.decoder_input_details,
                    generated_len: 0,
                    grammar: r.grammar.clone(),
                }
            })
            .collect();
        let prefill_tokens: u64 = seqs.iter().map(|s| s.entry.request.input_ids.len() as u64).sum();
        for mut s in seqs {
            s.seq_len = s.entry.request.input_ids.len() as u32;
            self.running.insert(s.id(), s);
        }
        let batch = pb::Batch { id, requests };
        let resp = self
            .client
            .prefill(pb::PrefillRequest { batch: Some(batch) })
            .await?;
        RouterState::add(&self.state.prefill_tokens_total, prefill_tokens);
        let ended = self.apply_generations(&resp.generations, true);
        if let Some(b) = resp.batch {
            self.batches.push(b);
        }
        self.filter(ended).await
    }

    async fn decode(&mut self) -> Result<(), RouterError> {
        let started = Instant::now();
        let mut slots = Vec::with_capacity(self.running.len());
        for b in &self.batches {
            for id in &b.request_ids {
                let s = self.running.get_mut(id).expect("cached request is running");
                // Grow only when this step's tokens cross a block boundary.
                let end = s.seq_len + 1 + self.speculate;
                let grown = s.blocks.ensure_capacity(end);
                assert!(grown, "reserved blocks are free");
                slots.push(pb::RequestSlots {
                    request_id: *id,
                    block_table: s.blocks.ids().to_vec(),
                    slots: s.blocks.slots(s.seq_len, end),
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
        // proposals) are simply overwritten by later steps.
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
            if prefill && seq.entry.request.decoder_input_details {
                if let Some(t) = &g.prefill_tokens {
                    seq.send_prefill_tokens(&ctx, t);
                }
            }
            generated += g.tokens.as_ref().map_or(0, |t| t.ids.len() as u64);
            match seq.apply(&ctx, g) {
                Outcome::Running => {}
                Outcome::FinishedByShard => finished.push(g.request_id),
                Outcome::EndedByRouter => ended.push(g.request_id),
            }
        }
        for id in finished.iter().chain(ended.iter()) {
            self.finish(*id);
        }
        RouterState::add(&self.state.generated_tokens_total, generated);
        ended
    }

    /// Removes a sequence; dropping it returns its blocks to the pool.
    fn finish(&mut self, id: u64) {
        if let Some(s) = self.running.remove(&id) {
            self.reserved.sub(s.reservation);
        }
    }

    /// Tells the shards to forget requests the router ended.
    async fn filter(&mut self, ended: Vec<u64>) -> Result<(), RouterError> {
        if ended.is_empty() {
            return Ok(());
        }
        let mut kept_batches = Vec::with_capacity(self.batches.len());
        for b in std::mem::take(&mut self.batches) {
            let keep: Vec<u64> = b
                .request_ids
                .iter()
                .copied()
                .filter(|id| self.running.contains_key(id))
                .collect();
            if keep.len() == b.request_ids.len() {
                kept_batches.push(b);
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
                if let Some(nb) = resp.batch {
                    kept_batches.push(nb);
                }
            }
        }
        self.batches = kept_batches;
        Ok(())
    }

    /// Clients that went away free their blocks before the next step runs.
    async fn drop_cancelled(&mut self) -> Result<(), RouterError> {
        let gone: Vec<u64> = self
            .running
            .values()
            .filter(|s| s.entry.is_cancelled())
            .map(|s| s.id())
            .collect();
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
            let _ = s.entry.response_tx.send(Err(err.clone()));
        }
        RouterState::add(&self.state.requests_failed, n);
        self.reserved = Reservation::default();
        self.batches.clear();
        // Best effort: a shard that is still alive should not keep stale batches.
        let _ = self.client.clear_cache(None).await;
    }

    fn publish(&self) {
        let st = &self.state;
        RouterState::set(&st.queue_size, self.queue.len() as u64);
        RouterState::set(&st.batch_size, self.running.len() as u64);
        RouterState::set(&st.kv_blocks_free, self.allocator.free_blocks() as u64);
    }
}
