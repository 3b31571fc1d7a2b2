//! Which queued requests join the running batch: first come, first served,
//! under the prefill token budget, the total token budget and the KV pool.
//!
//! A sequence is admitted only if its worst case (prompt + max_new_tokens)
//! fits next to the worst cases of everything running, so incremental block
//! growth can never fail mid-decode. Blocks are still taken as sequences
//! grow, which is what the pool's free count reports.

#[derive(Debug, Clone, Copy)]
pub struct Budget {
    pub max_batch_prefill_tokens: u32,
    pub max_batch_total_tokens: u64,
    pub max_batch_size: u32,
    pub block_size: u32,
    /// Blocks the allocator can hand out in all.
    pub capacity_blocks: u32,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Reservation {
    pub blocks: u32,
    pub tokens: u64,
}

impl Reservation {
    pub fn of(budget: &Budget, input_len: u32, max_new_tokens: u32) -> Self {
        let tokens = input_len as u64 + max_new_tokens as u64;
        Self {
            blocks: tokens.div_ceil(budget.block_size as u64) as u32,
            tokens,
        }
    }

    pub fn add(&mut self, other: Reservation) {
        self.blocks += other.blocks;
        self.tokens += other.tokens;
    }

    pub fn sub(&mut self, other: Reservation) {
        self.blocks -= other.blocks;
        self.tokens -= other.tokens;
    }
}

#[derive(Debug, Clone, Copy)]
pub struct Candidate {
    /// Prompt tokens the shard must compute in this prefill.
    pub prefill_tokens: u32,
    pub reservation: Reservation,
}

/// How many leading candidates can be admitted now. FIFO: the first one that
/// does not fit stops admission, so a long request is never starved by
/// shorter ones behind it.
pub fn admit(budget: &Budget, running_sequences: u32, running: Reservation, candidates: &[Candidate]) -> usize {
    let mut prefill = 0u32;
    let mut reserved = running;
    let mut admitted = 0;
    for c in candidates {
        if running_sequences + admitted as u32 >= budget.max_batch_size {
            break;
        }
        if prefill + c.prefill_tokens > budget.max_batch_prefill_tokens {
            break;
        }
        if reserved.blocks + c.reservation.blocks > budget.capacity_blocks
            || reserved.tokens + c.reservation.tokens > budget.max_batch_total_tokens
        {
            break;
        }
        prefill += c.prefill_tokens;
        reserved.add(c.reservation);
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
            block_size: 16,
            capacity_blocks: 50,
        }
    }

    fn cand(b: &Budget, input: u32, new: u32) -> Candidate {
        Candidate {
            prefill_tokens: input,
            reservation: Reservation::of(b, input, new),
        }
    }

    #[test]
    fn prefill_budget_limits_one_prefill() {
        let b = budget();
        let c = vec![cand(&b, 60, 1), cand(&b, 30, 1), cand(&b, 20, 1)];
        assert_eq!(admit(&b, 0, Reservation::default(), &c), 2);
    }

    #[test]
    fn total_budget_counts_running_sequences() {
        let b = budget();
        let running = Reservation { blocks: 10, tokens: 950 };
        let c = vec![cand(&b, 10, 30), cand(&b, 10, 50)];
        assert_eq!(admit(&b, 3, running, &c), 1);
    }

    #[test]
    fn kv_capacity_limits_admission() {
        let b = budget();
        let running = Reservation { blocks: 48, tokens: 100 };
        // 40 tokens = 3 blocks: does not fit in the 2 left.
        assert_eq!(admit(&b, 1, running, &[cand(&b, 20, 20)]), 0);
        assert_eq!(admit(&b, 1, running, &[cand(&b, 20, 12)]), 1);
    }

    #[test]
    fn fifo_does_not_skip_a_large_head() {
        let b = budget();
        let c = vec![cand(&b, 101, 1), cand(&b, 5, 1)];
        assert_eq!(admit(&b, 0, Reservation::default(), &c), 0);
    }

    #[test]
    fn batch_size_limit() {
        let b = budget();
        let c: Vec<_> = (0..10).map(|_| cand(&b, 1, 1)).collect();
        assert_eq!(admit(&b, 6, Reservation::default(), &c), 2);
    }

    proptest! {
        // Whatever arrives, what is admitted respects every budget at once.
        #[test]
        fn admitted_set_respects_all_budgets(
            reqs in prop::collection::vec((1u32..120, 1u32..300), 0..30),
            running_blocks in 0u32..50, running_tokens in 0u64..1000, running_seqs in 0u32..8,
        ) {
            let b = budget();
            let cands: Vec<_> = reqs.iter().map(|&(i, n)| cand(&b, i, n)).collect();
            let running = Reservation { blocks: running_blocks, tokens: running_tokens };
            let n = admit(&b, running_seqs, running, &cands);
            let prefill: u32 = cands[..n].iter().map(|c| c.prefill_tokens).sum();
            let mut total = running;
            for c in &cands[..n] { total.add(c.reservation); }
            prop_assert!(n == 0 || prefill <= b.max_batch_prefill_tokens);
            prop_assert!(n == 0 || total.blocks <= b.capacity_blocks);
            prop_assert!(n == 0 || total.tokens <= b.max_batch_total_tokens);
            prop_assert!(running_seqs + n as u32 <= b.max_batch_size.max(running_seqs));
            // Maximal: the next candidate, if any, would break a budget.
            if n < cands.len() && running_seqs + (n as u32) < b.max_batch_size {
                let c = cands[n];
                prop_assert!(prefill + c.prefill_tokens > b.max_batch_prefill_tokens
                    || total.blocks + c.reservation.blocks > b.capacity_blocks
                    || total.tokens + c.reservation.tokens > b.max_batch_total_tokens);
            }
        }
    }
}
