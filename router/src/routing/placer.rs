//! The routing layer in front of the shard groups: gathers each group's
//! figures (its exact cached prefix of the prompt, its load), applies the
//! rule and hands the request to that group's batching loop.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use tokio::sync::mpsc;

use super::rule::{choose, GroupLoad, Routing};
use crate::error::RouterError;
use crate::kv::KvManager;
use crate::queue::{Entry, ResponseTx};
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

pub struct Placer {
    groups: Vec<GroupHandle>,
    routing: Routing,
    cursor: AtomicUsize,
}

impl Placer {
    pub fn new(groups: Vec<GroupHandle>, routing: Routing) -> Self {
        Self { groups, routing, cursor: AtomicUsize::new(0) }
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

    /// Each group's figures for a prompt of `tokens`; `exclude` counts as out of rotation.
    fn loads(&self, tokens: &[u32], exclude: Option<usize>) -> Vec<GroupLoad> {
        self.groups
            .iter()
            .enumerate()
            .map(|(i, g)| {
                let s = &g.stats;
                let serving = s.serving() && Some(i) != exclude;
                let kv = g.kv.lock().unwrap_or_else(PoisonError::into_inner).clone();
                let cached_tokens = if serving && self.routing == Routing::Prefix {
                    kv.peek_prefix(tokens) as u64 * kv.block_size() as u64
                } else {
                    0
                };
                GroupLoad {
                    serving,
                    cached_tokens,
                    queued_tokens: RouterState::get(&s.queued_tokens) + RouterState::get(&s.pending_tokens),
                    running_tokens: RouterState::get(&s.running_tokens),
                    free_tokens: RouterState::get(&s.kv_blocks_free) * kv.block_size() as u64,
                    cache_tokens: RouterState::get(&s.kv_blocks_cached) * kv.block_size() as u64,
                }
            })
            .collect()
    }

    fn pick(&self, tokens: &[u32], need: u64, exclude: Option<usize>) -> Option<usize> {
        let cursor = self.cursor.fetch_add(1, Ordering::Relaxed);
        choose(self.routing, &self.loads(tokens, exclude), need, cursor)
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
        let need = (tokens.len() as u64 + first.request.max_new_tokens as u64) * entries.len() as u64;
        let mut arrivals: Vec<Arrival> = entries.into_iter().map(Arrival::New).collect();
        // A group whose loop has gone is taken out by `send`; try the others.
        for _ in 0..self.groups.len() {
            let Some(i) = self.pick(&tokens, need, None) else { break };
            arrivals = self.send(i, arrivals);
            if arrivals.is_empty() {
                RouterState::add(&self.groups[i].stats.placed_total, 1);
                return Ok(i);
            }
        }
        Err(RouterError::Unhealthy("no shard group is serving".into()))
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
                let Some(i) = self.pick(&s.tokens, need, Some(from)) else { break };
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
