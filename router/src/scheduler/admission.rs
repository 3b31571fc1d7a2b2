//! Which queued requests join the running batch, under the prefill token
//! budget, the batch token budget, the batch size and the KV blocks
//! available now. Nothing is reserved for future growth: when the pool runs
//! out mid-decode the scheduler preempts (see `preempt.rs`), which is what
//! lets far more sequences run than up-front reservation of
//! prompt + max_new_tokens would.

#[derive(Debug, Clone, Copy)]
pub struct Budget {
    pub max_batch_prefill_tokens: u32,
    pub max_batch_total_tokens: u64,
    pub max_batch_size: u32,
    /// Blocks kept free after admission so running sequences can grow for a
    /// while before anyone is preempted.
    pub watermark_blocks: u32,
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
}

/// How many leading candidates can be admitted now. First come, first
/// served: the first that does not fit stops admission, so a long request is
/// never starved by shorter ones behind it.
pub fn admit(budget: &Budget, running: Running, candidates: &[Candidate]) -> usize {
    let mut seqs = running.sequences;
    let mut tokens = running.tokens;
    let mut prefill = 0u32;
    let mut blocks = 0u32;
    let mut admitted = 0;
    for c in candidates {
        let fits = seqs + c.sequences <= budget.max_batch_size
            && prefill + c.prefill_tokens <= budget.max_batch_prefill_tokens
            && tokens + c.tokens <= budget.max_batch_total_tokens
            // An empty batch may dip into the watermark: it has no one to preempt for.
            && blocks + c.new_blocks + if seqs == 0 { 0 } else { budget.watermark_blocks }
                <= running.available_blocks;
        if !fits {
            break;
        }
        seqs += c.sequences;
        tokens += c.tokens;
        prefill += c.prefill_tokens;
        blocks += c.new_blocks;
        admitted += 1;
    }
    admitted
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
        }
    }

    fn cand(prefill: u32, blocks: u32) -> Candidate {
        Candidate {
            sequences: 1,
            prefill_tokens: prefill,
            tokens: prefill as u64,
            new_blocks: blocks,
        }
    }

    fn idle(blocks: u32) -> Running {
        Running {
            available_blocks: blocks,
            ..Running::default()
        }
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
        let fork = Candidate { sequences: 4, prefill_tokens: 40, tokens: 160, new_blocks: 6 };
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
                sequences: s, prefill_tokens: p, tokens: (p * s) as u64, new_blocks: n }).collect();
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
}
