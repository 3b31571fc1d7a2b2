//! Which queued requests join the running batch, under the prefill token
//! budget, the batch token budget, the batch size and the KV blocks
//! available now. Nothing is reserved for future growth: when the pool runs
//! out mid-decode the scheduler preempts (see `preempt.rs`), which is what
//! lets far more sequences run than up-front reservation of
//! prompt + max_new_tokens would.
//!
//! With chunked prefill (`Budget::prefill_chunk_tokens`) a step's prefill is
//! bounded by the chunk size instead, and the first candidate that does not
//! fit whole may still start with the part that does (`admit_chunked`).

#[derive(Debug, Clone, Copy)]
pub struct Budget {
    pub max_batch_prefill_tokens: u32,
    pub max_batch_total_tokens: u64,
    pub max_batch_size: u32,
    /// Blocks kept free after admission so running sequences can grow for a
    /// while before anyone is preempted.
    pub watermark_blocks: u32,
    /// Prefill tokens per step when prompts may be split across steps
    /// (chunked prefill); `None`: every prompt is prefilled in one step.
    pub prefill_chunk_tokens: Option<u32>,
}

/// What the running batch holds now.
#[derive(Debug, Clone, Copy, Default)]
pub struct Running {
    pub sequences: u32,
    pub tokens: u64,
    /// Blocks an allocation can get now (free + evictable cached).
    pub available_blocks: u32,
}

/// One admission unit: a request, or all forks of an `n`/`best_of` request.
#[derive(Debug, Clone, Copy)]
pub struct Candidate {
    pub sequences: u32,
    /// Tokens the shard computes in the prefill (uncached part).
    pub prefill_tokens: u32,
    /// Context tokens the unit adds to the batch.
    pub tokens: u64,
    /// Fresh blocks it needs now.
    pub new_blocks: u32,
    /// Whether its prefill may be split across steps (a single sequence
    /// without prompt logprobs; forks share blocks their leader writes).
    pub chunkable: bool,
}

/// What `admit_chunked` lets into this step's prefill.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Admission {
    /// Leading candidates prefilled whole.
    pub whole: usize,
    /// The candidate after them starts with this many of its prefill tokens.
    pub partial: Option<u32>,
}

/// How many leading candidates can be admitted now. First come, first
/// served: the first that does not fit stops admission, so a long request is
/// never starved by shorter ones behind it.
pub fn admit(budget: &Budget, running: Running, candidates: &[Candidate]) -> usize {
    let mut acc = Totals::from(running);
    let mut admitted = 0;
    for c in candidates {
        if !(acc.fits_besides_prefill(budget, running, c)
            && acc.prefill + c.prefill_tokens <= budget.max_batch_prefill_tokens)
        {
            break;
        }
        acc.add(c);
        admitted += 1;
    }
    admitted
}

/// Admission for one step of chunked prefill with `step_tokens` prefill
/// tokens left: candidates that fit whole, then possibly the start of the
/// next one (if it is chunkable and fits every other budget). A candidate
/// that cannot be split and exceeds the chunk goes alone into a step of its
/// own, within `max_batch_prefill_tokens`, when `alone_ok` (no other prompt
/// is in this step).
pub fn admit_chunked(
    budget: &Budget,
    running: Running,
    candidates: &[Candidate],
    step_tokens: u32,
    alone_ok: bool,
) -> Admission {
    let per_step = Budget { max_batch_prefill_tokens: step_tokens.min(budget.max_batch_prefill_tokens), ..*budget };
    let whole = admit(&per_step, running, candidates);
    let Some(next) = candidates.get(whole) else {
        return Admission { whole, partial: None };
    };
    let mut acc = Totals::from(running);
    candidates[..whole].iter().for_each(|c| acc.add(c));
    if !acc.fits_besides_prefill(budget, running, next) {
        return Admission { whole, partial: None };
    }
    let left = per_step.max_batch_prefill_tokens - acc.prefill;
    if next.chunkable && left > 0 {
        return Admission { whole, partial: Some(left) };
    }
    if whole == 0 && alone_ok && next.prefill_tokens <= budget.max_batch_prefill_tokens {
        // Unsplittable and larger than a chunk: a prefill step of its own.
        return Admission { whole: 1, partial: None };
    }
    Admission { whole, partial: None }
}

/// Whether `c` alone fits the batch's seats, tokens and KV blocks now
/// (everything but this step's prefill budget, which chunking can meet).
pub fn fits_resources(budget: &Budget, running: Running, c: &Candidate) -> bool {
    Totals::from(running).fits_besides_prefill(budget, running, c)
}

/// Running totals during admission.
struct Totals {
    seqs: u32,
    tokens: u64,
    prefill: u32,
    blocks: u32,
}

impl Totals {
    fn from(running: Running) -> Self {
        Self { seqs: running.sequences, tokens: running.tokens, prefill: 0, blocks: 0 }
    }

    fn add(&mut self, c: &Candidate) {
        self.seqs += c.sequences;
        self.tokens += c.tokens;
        self.prefill += c.prefill_tokens;
        self.blocks += c.new_blocks;
    }

    fn fits_besides_prefill(&self, budget: &Budget, running: Running, c: &Candidate) -> bool {
        self.seqs + c.sequences <= budget.max_batch_size
            && self.tokens + c.tokens <= budget.max_batch_total_tokens
            // An empty batch may dip into the watermark: it has no one to preempt for.
            && self.blocks + c.new_blocks + if self.seqs == 0 { 0 } else { budget.watermark_blocks }
                <= running.available_blocks
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn budget() -> Budget {
        Budget {
            max_batch_prefill_tokens: 100,
            max_batch_total_tokens: 1000,
            max_batch_size: 8,
            watermark_blocks: 2,
            prefill_chunk_tokens: None,
        }
    }

    fn cand(prefill: u32, blocks: u32) -> Candidate {
        Candidate { sequences: 1, prefill_tokens: prefill, tokens: prefill as u64, new_blocks: blocks, chunkable: true }
    }

    fn idle(blocks: u32) -> Running {
        Running { available_blocks: blocks, ..Running::default() }
    }

    #[test]
    fn prefill_budget_limits_one_prefill() {
        let c = vec![cand(60, 1), cand(30, 1), cand(20, 1)];
        assert_eq!(admit(&budget(), idle(50), &c), 2);
    }

    #[test]
    fn total_budget_counts_running_tokens() {
        let running = Running { sequences: 3, tokens: 950, available_blocks: 50 };
        assert_eq!(admit(&budget(), running, &[cand(40, 3), cand(20, 2)]), 1);
    }

    #[test]
    fn available_blocks_and_watermark_limit_admission() {
        let running = Running { sequences: 1, tokens: 10, available_blocks: 5 };
        assert_eq!(admit(&budget(), running, &[cand(10, 4)]), 0);
        assert_eq!(admit(&budget(), running, &[cand(10, 3)]), 1);
        // With nothing running, the watermark does not apply.
        assert_eq!(admit(&budget(), idle(4), &[cand(10, 4)]), 1);
    }

    #[test]
    fn fifo_does_not_skip_a_large_head() {
        assert_eq!(admit(&budget(), idle(50), &[cand(101, 1), cand(5, 1)]), 0);
    }

    #[test]
    fn forks_are_admitted_whole() {
        let fork = Candidate { sequences: 4, prefill_tokens: 40, tokens: 160, new_blocks: 6, chunkable: false };
        let running = Running { sequences: 5, tokens: 0, available_blocks: 50 };
        assert_eq!(admit(&budget(), running, &[fork]), 0);
        assert_eq!(admit(&budget(), Running { sequences: 4, ..running }, &[fork]), 1);
    }

    proptest! {
        // Whatever arrives, what is admitted respects every budget at once,
        // and admission is maximal for FIFO order.
        #[test]
        fn admitted_set_respects_all_budgets(
            reqs in prop::collection::vec((1u32..4, 1u32..120, 0u32..12), 0..30),
            seqs in 0u32..8, tokens in 0u64..1000, avail in 0u32..60,
        ) {
            let b = budget();
            let cands: Vec<_> = reqs.iter().map(|&(s, p, n)| Candidate {
                sequences: s, prefill_tokens: p, tokens: (p * s) as u64, new_blocks: n, chunkable: s == 1 }).collect();
            let running = Running { sequences: seqs, tokens, available_blocks: avail };
            let n = admit(&b, running, &cands);
            let sum = |f: &dyn Fn(&Candidate) -> u64| cands[..n].iter().map(f).sum::<u64>();
            let (s, p, t, k) = (sum(&|c| c.sequences as u64), sum(&|c| c.prefill_tokens as u64),
                                sum(&|c| c.tokens), sum(&|c| c.new_blocks as u64));
            if n > 0 {
                prop_assert!(seqs as u64 + s <= b.max_batch_size as u64);
                prop_assert!(p <= b.max_batch_prefill_tokens as u64);
                prop_assert!(tokens + t <= b.max_batch_total_tokens);
                prop_assert!(k <= avail as u64);
            }
            if n < cands.len() {
                let c = cands[n];
                let ws = if seqs as u64 + s == 0 { 0 } else { b.watermark_blocks as u64 };
                prop_assert!(seqs as u64 + s + c.sequences as u64 > b.max_batch_size as u64
                    || p + c.prefill_tokens as u64 > b.max_batch_prefill_tokens as u64
                    || tokens + t + c.tokens > b.max_batch_total_tokens
                    || k + c.new_blocks as u64 + ws > avail as u64);
            }
        }
    }

    fn chunked(chunk: u32) -> Budget {
        Budget { prefill_chunk_tokens: Some(chunk), ..budget() }
    }

    #[test]
    fn chunked_admission_starts_the_first_prompt_that_does_not_fit() {
        let c = vec![cand(20, 1), cand(25, 2), cand(40, 3), cand(5, 1)];
        let a = admit_chunked(&chunked(50), idle(50), &c, 50, true);
        assert_eq!(a, Admission { whole: 2, partial: Some(5) });
        // Exactly filling the chunk leaves nothing to start.
        let a = admit_chunked(&chunked(45), idle(50), &c, 45, true);
        assert_eq!(a, Admission { whole: 2, partial: None });
    }

    #[test]
    fn chunked_admission_still_needs_every_block_and_seat() {
        let c = vec![cand(80, 10)];
        assert_eq!(admit_chunked(&chunked(50), idle(9), &c, 50, true), Admission { whole: 0, partial: None });
        assert_eq!(admit_chunked(&chunked(50), idle(10), &c, 50, true), Admission { whole: 0, partial: Some(50) });
        let full = Running { sequences: 8, tokens: 0, available_blocks: 50 };
        assert_eq!(admit_chunked(&chunked(50), full, &c, 50, true), Admission { whole: 0, partial: None });
    }

    #[test]
    fn unsplittable_prompt_larger_than_a_chunk_gets_a_step_alone() {
        let fork = Candidate { sequences: 2, prefill_tokens: 90, tokens: 180, new_blocks: 4, chunkable: false };
        assert_eq!(admit_chunked(&chunked(50), idle(50), &[fork], 50, true), Admission { whole: 1, partial: None });
        // Not after a chunk of someone else in the same step, nor beyond max_batch_prefill_tokens.
        assert_eq!(admit_chunked(&chunked(50), idle(50), &[fork], 20, false), Admission { whole: 0, partial: None });
        let huge = Candidate { prefill_tokens: 101, ..fork };
        assert_eq!(admit_chunked(&chunked(50), idle(50), &[huge], 50, true), Admission { whole: 0, partial: None });
    }

    proptest! {
        // A chunked step never computes more than its chunk (except an
        // unsplittable unit alone), splits only chunkable candidates, and
        // keeps every other budget of the whole-prompt rule.
        #[test]
        fn chunked_step_respects_chunk_and_budgets(
            reqs in prop::collection::vec((1u32..3, 1u32..120, 0u32..12), 0..30),
            seqs in 0u32..8, tokens in 0u64..1000, avail in 0u32..60, chunk in 1u32..100, used in 0u32..100,
        ) {
            let b = chunked(chunk);
            let step = chunk - used.min(chunk - 1);
            let cands: Vec<_> = reqs.iter().map(|&(s, p, n)| Candidate {
                sequences: s, prefill_tokens: p, tokens: (p * s) as u64, new_blocks: n, chunkable: s == 1 }).collect();
            let running = Running { sequences: seqs, tokens, available_blocks: avail };
            let a = admit_chunked(&b, running, &cands, step, step == chunk);
            let taken = &cands[..a.whole + a.partial.is_some() as usize];
            let whole_prefill: u32 = cands[..a.whole].iter().map(|c| c.prefill_tokens).sum();
            let alone = a.whole == 1 && a.partial.is_none() && !cands[0].chunkable && step == chunk;
            prop_assert!(whole_prefill + a.partial.unwrap_or(0) <= step || alone);
            prop_assert!(whole_prefill <= b.max_batch_prefill_tokens);
            if let Some(p) = a.partial {
                let c = cands[a.whole];
                prop_assert!(c.chunkable && p > 0 && p < c.prefill_tokens);
            }
            let s: u64 = taken.iter().map(|c| c.sequences as u64).sum();
            let t: u64 = taken.iter().map(|c| c.tokens).sum();
            let k: u64 = taken.iter().map(|c| c.new_blocks as u64).sum();
            if !taken.is_empty() {
                prop_assert!(seqs as u64 + s <= b.max_batch_size as u64);
                prop_assert!(tokens + t <= b.max_batch_total_tokens);
                prop_assert!(k <= avail as u64);
            }
        }
    }
}
