//! The routing layer in front of the shard groups: gathers each group's
//! figures (its exact cached prefix of the prompt, its load), applies the
//! rule and hands the request to that group's batching loop.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use tokio::sync::mpsc;

use super::placed::{prefix_keys, PlacedPrefixes};
use super::rule::{choose, GroupLoad, Routing};
use crate::adapter::{Adapter, AdapterRef};
use crate::error::RouterError;
use crate::kv::KvManager;
use crate::queue::{Entry, ResponseTx, SeqEvent};
use crate::scheduler::Sequence;
use crate::shared_state::{GroupStats, RouterState};

/// What a group's loop receives.
#[derive(Debug)]
pub enum Arrival {
    /// A new request (one entry; the `n` forks of a request all go to one group).
    New(Entry),
    /// A sequence taken from a group that failed: it resumes here by
    /// recomputing its prompt and the tokens it already streamed, as a
    /// preempted sequence does.
    Resume(Sequence, ResponseTx),
}

impl Arrival {
    /// Prompt tokens it brings to compute: its `pending_tokens` share.
    pub fn tokens(&self) -> u64 {
        match self {
            Arrival::New(e) => e.request.input_ids.len() as u64,
            Arrival::Resume(s, _) => s.tokens.len() as u64,
        }
    }
}

/// One group as placement sees it.
pub struct GroupHandle {
    pub tx: mpsc::UnboundedSender<Arrival>,
    /// The group's KV manager (replaced when the group comes back with a fresh pool).
    pub kv: Arc<Mutex<KvManager>>,
    pub stats: Arc<GroupStats>,
}

/// A prompt placed on a group: its request's stream (alive while the
/// request is) and its tokens and adapter (to see when the group caches them).
struct Watch {
    stream: mpsc::WeakUnboundedSender<Result<SeqEvent, RouterError>>,
    tokens: Vec<u32>,
    adapter: Option<AdapterRef>,
}

pub struct Placer {
    groups: Vec<GroupHandle>,
    routing: Routing,
    cursor: AtomicUsize,
    /// Prompts placed and not yet cached where they went (`--routing prefix`).
    placed: Mutex<PlacedPrefixes<Watch>>,
}

impl Placer {
    pub fn new(groups: Vec<GroupHandle>, routing: Routing) -> Self {
        let placed = Mutex::new(PlacedPrefixes::new(groups.len()));
        Self { groups, routing, cursor: AtomicUsize::new(0), placed }
    }

    /// One group, no choice: what tests and a single-group router use.
    pub fn single(tx: mpsc::UnboundedSender<Arrival>, kv: KvManager, router: &RouterState) -> Self {
        let stats = router.groups.first().cloned().unwrap_or_else(|| {
            let g = GroupStats::default();
            g.serving.store(true, Ordering::SeqCst);
            Arc::new(g)
        });
        Self::new(vec![GroupHandle { tx, kv: Arc::new(Mutex::new(kv)), stats }], Routing::RoundRobin)
    }

    /// Group `i`'s KV manager and figures (what its loop starts from).
    pub fn group(&self, i: usize) -> (KvManager, Arc<GroupStats>) {
        let g = &self.groups[i];
        (g.kv.lock().unwrap_or_else(PoisonError::into_inner).clone(), g.stats.clone())
    }

    /// Group `i` came back with a fresh pool.
    pub fn set_kv(&self, i: usize, kv: KvManager) {
        *self.groups[i].kv.lock().unwrap_or_else(PoisonError::into_inner) = kv;
    }

    pub fn stats(&self) -> impl Iterator<Item = &Arc<GroupStats>> {
        self.groups.iter().map(|g| &g.stats)
    }

    pub fn routing(&self) -> Routing {
        self.routing
    }

    pub fn num_groups(&self) -> usize {
        self.groups.len()
    }

    fn kv(&self, i: usize) -> KvManager {
        self.groups[i].kv.lock().unwrap_or_else(PoisonError::into_inner).clone()
    }

    /// Chain keys of the blocks of `tokens` a hit can cover (one token is
    /// always computed), as `adapter` computes them.
    fn keys(&self, adapter: Option<&Adapter>, tokens: &[u32]) -> Vec<u64> {
        let bs = self.kv(0).block_size() as usize;
        prefix_keys(adapter.map_or(0, |a| a.id), tokens, bs, tokens.len().saturating_sub(1) / bs)
    }

    /// Each group's figures for a prompt of `tokens` with `adapter`; `exclude` counts as out of rotation.
    fn loads(&self, adapter: Option<&Adapter>, tokens: &[u32], exclude: Option<usize>) -> Vec<GroupLoad> {
        let prefix = self.routing == Routing::Prefix;
        let keys = if prefix { self.keys(adapter, tokens) } else { Vec::new() };
        let placed = self.placed.lock().unwrap_or_else(PoisonError::into_inner);
        self.groups
            .iter()
            .enumerate()
            .map(|(i, g)| {
                let s = &g.stats;
                let serving = s.serving() && Some(i) != exclude;
                let kv = self.kv(i);
                let bs = kv.block_size() as u64;
                let (cached_tokens, placed_tokens) = if serving && prefix {
                    (kv.peek_prefix(adapter, tokens) as u64 * bs, placed.longest(i, &keys) as u64 * bs)
                } else {
                    (0, 0)
                };
                GroupLoad {
                    serving,
                    cached_tokens,
                    placed_tokens,
                    queued_tokens: RouterState::get(&s.queued_tokens) + RouterState::get(&s.pending_tokens),
                    running_tokens: RouterState::get(&s.running_tokens),
                    free_tokens: RouterState::get(&s.kv_blocks_free) * kv.block_size() as u64,
                    cache_tokens: RouterState::get(&s.kv_blocks_cached) * kv.block_size() as u64,
                }
            })
            .collect()
    }

    fn pick(&self, adapter: Option<&Adapter>, tokens: &[u32], need: u64, exclude: Option<usize>) -> Option<usize> {
        let cursor = self.cursor.fetch_add(1, Ordering::Relaxed);
        choose(self.routing, &self.loads(adapter, tokens, exclude), need, cursor)
    }

    /// Sends `arrivals` (one request, or the sequences of one failed group
    /// that share nothing) to group `i`; what cannot be sent (its loop is
    /// gone) comes back.
    fn send(&self, i: usize, arrivals: Vec<Arrival>) -> Vec<Arrival> {
        let g = &self.groups[i];
        let mut back = Vec::new();
        for a in arrivals {
            let tokens = a.tokens();
            RouterState::add(&g.stats.pending_tokens, tokens);
            if let Err(mpsc::error::SendError(a)) = g.tx.send(a) {
                g.stats.pending_tokens.fetch_sub(tokens, Ordering::Relaxed);
                g.stats.serving.store(false, Ordering::SeqCst);
                back.push(a);
            }
        }
        back
    }

    /// Places the entries of one request (its `n` forks together) on one
    /// group; returns its index.
    pub fn place(&self, entries: Vec<Entry>) -> Result<usize, RouterError> {
        let Some(first) = entries.first() else { return Err(RouterError::Generation("nothing to place".into())) };
        let tokens = first.request.input_ids.clone();
        let adapter = first.request.adapter.clone();
        let stream = first.response_tx.downgrade();
        let need = (tokens.len() as u64 + first.request.max_new_tokens as u64) * entries.len() as u64;
        let mut arrivals: Vec<Arrival> = entries.into_iter().map(Arrival::New).collect();
        self.forget_settled();
        // A group whose loop has gone is taken out by `send`; try the others.
        for _ in 0..self.groups.len() {
            let Some(i) = self.pick(adapter.as_deref(), &tokens, need, None) else { break };
            arrivals = self.send(i, arrivals);
            if arrivals.is_empty() {
                RouterState::add(&self.groups[i].stats.placed_total, 1);
                self.remember(i, Watch { stream, tokens, adapter });
                return Ok(i);
            }
        }
        Err(RouterError::Unhealthy("no shard group is serving".into()))
    }

    /// A prompt placed on group `i` counts there until its blocks are cached.
    fn remember(&self, i: usize, watch: Watch) {
        if self.routing == Routing::Prefix && self.groups.len() > 1 {
            let keys = self.keys(watch.adapter.as_deref(), &watch.tokens);
            self.placed.lock().unwrap_or_else(PoisonError::into_inner).record(i, watch, keys);
        }
    }

    /// Placed prompts whose request ended or whose blocks their group caches now are forgotten.
    fn forget_settled(&self) {
        let kvs: Vec<KvManager> = (0..self.groups.len()).map(|i| self.kv(i)).collect();
        self.placed.lock().unwrap_or_else(PoisonError::into_inner).retain(|g, w, keys| {
            let alive = w.stream.upgrade().is_some_and(|tx| !tx.is_closed());
            alive && (kvs[g].peek_prefix(w.adapter.as_deref(), &w.tokens) as usize) < keys.len()
        });
    }

    /// Re-places sequences of group `from`, which failed, on the other
    /// serving groups, one by one (each to its best group). Those that find
    /// none come back.
    pub fn requeue(&self, from: usize, seqs: Vec<(Sequence, ResponseTx)>) -> Vec<(Sequence, ResponseTx)> {
        let mut left = Vec::new();
        for (s, tx) in seqs {
            let need = s.tokens.len() as u64 + s.request.max_new_tokens.saturating_sub(s.generated) as u64;
            let mut a = vec![Arrival::Resume(s, tx)];
            for _ in 0..self.groups.len() {
                let Arrival::Resume(s, _) = &a[0] else { unreachable!() };
                let Some(i) = self.pick(s.adapter(), &s.tokens, need, Some(from)) else { break };
                a = self.send(i, a);
                if a.is_empty() {
                    break;
                }
            }
            if let Some(Arrival::Resume(s, tx)) = a.pop() {
                left.push((s, tx));
            }
        }
        left
    }
}

#[cfg(test)]
mod tests {
    use std::time::Instant;

    use super::*;
    use crate::proto::pb;
    use crate::request::ValidRequest;

    fn placer() -> (Placer, Vec<mpsc::UnboundedReceiver<Arrival>>) {
        let state = RouterState::with_groups(2);
        let mut rxs = Vec::new();
        let groups = (0..2)
            .map(|i| {
                let (tx, rx) = mpsc::unbounded_channel();
                rxs.push(rx);
                let kv = KvManager::new(64, 4, true);
                RouterState::set(&state.groups[i].kv_blocks_free, 63);
                GroupHandle { tx, kv: Arc::new(Mutex::new(kv)), stats: state.groups[i].clone() }
            })
            .collect();
        (Placer::new(groups, Routing::Prefix), rxs)
    }

    fn entry(id: u64, prompt: Vec<u32>) -> (Entry, mpsc::UnboundedReceiver<Result<SeqEvent, RouterError>>) {
        let (tx, rx) = mpsc::unbounded_channel();
        let request = ValidRequest {
            inputs: String::new(),
            input_ids: prompt,
            parameters: pb::NextTokenChooserParameters::default(),
            max_new_tokens: 4,
            ignore_eos: true,
            min_new_tokens: 0,
            stop_token_ids: vec![],
            stop_sequences: vec![],
            top_n_tokens: 0,
            decoder_input_details: false,
            prompt_top_n: 0,
            seed: None,
            grammar: None,
            priority: 0,
            tenant: None,
            adapter: None,
        };
        (Entry { id, request, response_tx: tx, queued_at: Instant::now(), queue_deadline: None, group: None }, rx)
    }

    fn system(k: u32) -> Vec<u32> {
        (0..40).map(|i| 10 + k * 100 + i).collect()
    }

    #[test]
    fn requests_sharing_a_new_prefix_go_where_the_first_went_until_it_ends() {
        let (p, mut rxs) = placer();
        let (e0, _s0) = entry(0, [system(1), vec![1, 2]].concat());
        let first = p.place(vec![e0]).unwrap();
        // Nothing is cached yet, and group `first` has work queued: without the
        // placed prefix the next request would go to the other group.
        let (e1, _s1) = entry(1, [system(1), vec![3, 4]].concat());
        assert_eq!(p.place(vec![e1]).unwrap(), first);
        let (e2, _s2) = entry(2, [system(2), vec![1]].concat());
        assert_ne!(p.place(vec![e2]).unwrap(), first, "another new prefix spreads");
        // The first two requests end (their loop drops their streams): forgotten.
        while let Ok(a) = rxs[first].try_recv() {
            drop(a);
        }
        let (e3, _s3) = entry(3, [system(1), vec![5]].concat());
        p.forget_settled();
        assert_eq!(p.placed.lock().unwrap().longest(first, &p.keys(None, &e3.request.input_ids)), 0);
    }
}
