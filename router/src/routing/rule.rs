//! The placement rule, pure: figures in, group index out.
//!
//! `prefix` (default): each serving group g scores
//!
//! ```text
//! score(g) = cached(g) - (queued(g) + running(g)) / LOAD_TOKENS_PER_CACHED_TOKEN - shortfall(g)
//! ```
//!
//! where `cached` is the longest prefix of the prompt g's radix tree holds,
//! or that a prompt placed on g and not yet cached there shares with it,
//! whichever is longer (tokens a hit saves computing: a placed prefix is
//! computed once there, and a request sharing it waits for it), `queued` the prompt tokens g still has to
//! compute (its queue plus requests placed but not yet taken), `running` the
//! tokens of g's running sequences (its decode work and KV), and `shortfall`
//! the tokens of the request that do not fit g's free (or evictable) blocks
//! (it would have to wait or preempt there). The highest score wins. Ties
//! (typically a prompt no group holds) go to the lighter group, then to the
//! one whose prefix cache holds fewer tokens, so that new prefixes spread
//! over the groups instead of piling on one, then to the first group at or
//! after the rotating `cursor`.
//! `least-load`: the fewest queued + running tokens (ties as above).
//! `round-robin`: the first serving group at or after the cursor.

use std::fmt;

/// `--routing`: how a request's group is chosen.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Routing {
    /// Longest cached prefix, balanced against load (the rule above).
    Prefix,
    /// Fewest queued and running tokens.
    LeastLoad,
    /// Each serving group in turn.
    RoundRobin,
}

impl fmt::Display for Routing {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Routing::Prefix => "prefix",
            Routing::LeastLoad => "least-load",
            Routing::RoundRobin => "round-robin",
        })
    }
}

/// One group's figures at placement time.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct GroupLoad {
    /// In rotation (its loop runs and its shards answer).
    pub serving: bool,
    /// Tokens of the prompt its radix tree holds (block-aligned).
    pub cached_tokens: u64,
    /// Tokens of the prompt's prefix that prompts placed on it share and
    /// its cache does not hold yet (routing/placed.rs).
    pub placed_tokens: u64,
    pub queued_tokens: u64,
    pub running_tokens: u64,
    /// Free and evictable KV slots, in tokens.
    pub free_tokens: u64,
    /// Tokens its prefix cache holds (all prompts): breaks ties.
    pub cache_tokens: u64,
}

impl GroupLoad {
    fn load(&self) -> u64 {
        self.queued_tokens + self.running_tokens
    }
}

/// A token of load counts as much as this fraction of a cached token: a
/// cached token saves one token of prefill for this request, while a queued
/// or running token only delays it by a share of a step (a group computes
/// several sequences' tokens per step). 4 keeps a long shared prefix on its
/// group until that group holds about 4x its length more work than another.
pub const LOAD_TOKENS_PER_CACHED_TOKEN: i64 = 4;

/// The prefix score of one group for a request of `need_tokens` (prompt +
/// max new tokens); see the module doc.
pub fn prefix_score(g: &GroupLoad, need_tokens: u64) -> i64 {
    let load = g.load() as i64;
    let shortfall = need_tokens.saturating_sub(g.free_tokens) as i64;
    g.cached_tokens.max(g.placed_tokens) as i64 - load / LOAD_TOKENS_PER_CACHED_TOKEN - shortfall
}

/// The group to place a request of `need_tokens` on; None when no group serves.
pub fn choose(routing: Routing, groups: &[GroupLoad], need_tokens: u64, cursor: usize) -> Option<usize> {
    let n = groups.len();
    // Serving groups in rotation order from the cursor: the order ties resolve in.
    let order = (0..n).map(|k| (cursor + k) % n.max(1)).filter(|&i| groups[i].serving);
    match routing {
        Routing::RoundRobin => order.take(1).next(),
        // min_by_key keeps the first minimum in rotation order (max_by_key the last): score negated.
        Routing::LeastLoad => order.min_by_key(|&i| (groups[i].load(), groups[i].cache_tokens)),
        Routing::Prefix => {
            order.min_by_key(|&i| (-prefix_score(&groups[i], need_tokens), groups[i].load(), groups[i].cache_tokens))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn idle(free: u64) -> GroupLoad {
        GroupLoad { serving: true, free_tokens: free, ..Default::default() }
    }

    #[test]
    fn round_robin_skips_groups_out_of_rotation() {
        let mut g = vec![idle(100); 3];
        assert_eq!(choose(Routing::RoundRobin, &g, 10, 0), Some(0));
        assert_eq!(choose(Routing::RoundRobin, &g, 10, 4), Some(1));
        g[1].serving = false;
        assert_eq!(choose(Routing::RoundRobin, &g, 10, 1), Some(2));
        g[0].serving = false;
        g[2].serving = false;
        assert_eq!(choose(Routing::RoundRobin, &g, 10, 1), None);
        assert_eq!(choose(Routing::Prefix, &g, 10, 1), None);
        assert_eq!(choose(Routing::LeastLoad, &[], 10, 1), None);
    }

    #[test]
    fn least_load_takes_the_emptiest_and_rotates_ties() {
        let mut g = vec![idle(100); 3];
        g[0].queued_tokens = 50;
        g[1].running_tokens = 20;
        g[2].running_tokens = 20;
        assert_eq!(choose(Routing::LeastLoad, &g, 10, 0), Some(1));
        assert_eq!(choose(Routing::LeastLoad, &g, 10, 2), Some(2));
    }

    #[test]
    fn prefix_goes_where_the_prompt_is_cached() {
        let mut g = vec![idle(1000); 2];
        g[1].cached_tokens = 64;
        for cursor in 0..4 {
            assert_eq!(choose(Routing::Prefix, &g, 100, cursor), Some(1));
        }
        // Nothing cached anywhere: the cursor spreads new prompts.
        g[1].cached_tokens = 0;
        assert_eq!(choose(Routing::Prefix, &g, 100, 0), Some(0));
        assert_eq!(choose(Routing::Prefix, &g, 100, 1), Some(1));
        // ... after the group whose cache holds less, whatever the cursor.
        g[0].cache_tokens = 640;
        g[1].cache_tokens = 320;
        assert_eq!(choose(Routing::Prefix, &g, 100, 0), Some(1));
        assert_eq!(choose(Routing::LeastLoad, &g, 100, 0), Some(1));
    }

    #[test]
    fn load_outweighs_a_cached_prefix_past_the_ratio() {
        let mut g = vec![idle(10_000); 2];
        g[0].cached_tokens = 64;
        // 64 cached tokens are worth 256 tokens of load.
        g[0].running_tokens = 255;
        assert_eq!(choose(Routing::Prefix, &g, 100, 1), Some(0));
        g[0].running_tokens = 200;
        g[0].queued_tokens = 60;
        assert_eq!(choose(Routing::Prefix, &g, 100, 0), Some(1));
        assert_eq!(prefix_score(&g[0], 100), 64 - 260 / 4);
    }

    #[test]
    fn a_prefix_placed_but_not_cached_draws_the_next_request_sharing_it() {
        // Request 1 (a new 256-token prefix) went to group 0: its prompt is
        // queued there, nothing is cached anywhere yet.
        let mut g = vec![idle(10_000); 2];
        g[0].queued_tokens = 300;
        for cursor in 0..4 {
            assert_eq!(choose(Routing::Prefix, &g, 300, cursor), Some(1), "without the placed prefix: spread");
        }
        g[0].placed_tokens = 256;
        for cursor in 0..4 {
            assert_eq!(choose(Routing::Prefix, &g, 300, cursor), Some(0));
        }
        // Counted once: a group that also caches part of it gains nothing more.
        g[0].cached_tokens = 128;
        assert_eq!(prefix_score(&g[0], 300), 256 - 300 / 4);
        // Load still outweighs it past the ratio.
        g[0].running_tokens = 1000;
        assert_eq!(choose(Routing::Prefix, &g, 300, 0), Some(1));
    }

    #[test]
    fn a_group_without_room_loses_its_cache_advantage() {
        let mut g = vec![idle(1000), idle(40)];
        g[1].cached_tokens = 32;
        // Needs 100 tokens; group 1 has room for 40: shortfall 60 > 32 saved.
        assert_eq!(choose(Routing::Prefix, &g, 100, 1), Some(0));
        g[1].free_tokens = 90;
        assert_eq!(choose(Routing::Prefix, &g, 100, 0), Some(1));
    }
}
