//! How many KV blocks a request needs over its whole life, and the error
//! when the pool can never hold them. Validation refuses such a request
//! before it is queued; the scheduler checks again (scheduler/too_large.rs).

use crate::error::RouterError;

/// KV blocks a request needs at its longest: every prompt token and every
/// generated token but the last (which is sampled, never fed back), plus
/// the speculative proposal slots of its last decode step. `n` forks share
/// their prompt's full blocks (all but the last prompt token) and each
/// needs its own blocks for the rest.
pub fn lifetime_blocks(prompt_len: u32, max_new_tokens: u32, speculate: u32, n: u32, block_size: u32) -> u64 {
    let longest = prompt_len as u64 + (max_new_tokens as u64).saturating_sub(1) + speculate as u64;
    let per_fork = longest.div_ceil(block_size as u64);
    let shared = (prompt_len.saturating_sub(1) / block_size) as u64;
    shared + n.max(1) as u64 * (per_fork - shared.min(per_fork))
}

/// The client-facing error: a 4xx in every API's shape (`validation`).
pub fn too_large(needed: u64, capacity: u32, block_size: u32) -> RouterError {
    RouterError::Validation(format!(
        "`inputs` tokens + `max_new_tokens` can never fit the KV cache: the request needs {needed} blocks \
         of {block_size} tokens at its longest, the pool holds {capacity} ({} tokens); shorten the prompt \
         or lower `max_new_tokens`",
        capacity as u64 * block_size as u64
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lifetime_counts_prompt_generated_but_last_and_proposals() {
        // 10 + 6 - 1 = 15 tokens: 4 blocks of 4; 16 tokens would need 4 too, 17 five.
        assert_eq!(lifetime_blocks(10, 6, 0, 1, 4), 4);
        assert_eq!(lifetime_blocks(10, 8, 0, 1, 4), 5);
        assert_eq!(lifetime_blocks(10, 6, 2, 1, 4), 5);
        // 3 forks share the 2 full prompt blocks (positions 0..8), each needs 2 more.
        assert_eq!(lifetime_blocks(10, 6, 0, 3, 4), 2 + 3 * 2);
    }
}
