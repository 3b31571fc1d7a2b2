//! Blocks a prompt is about to compute, announced to KV-event consumers when
//! it is admitted rather than once its prefill is done.
//!
//! Why: a request that arrives while a running prompt computes its prefix
//! waits here for those blocks instead of computing them again
//! (scheduler/in_flight.rs), so a router reading the events (vllm-router's
//! `kv_aware`, llm-d's indexer) should send it to this server too. Announced
//! only after the prefill, a new prefix that several requests share is
//! spread by load over every server while the first one computes it.
//!
//! What consumers see is the prefix cache plus these in-flight blocks: a
//! block is stored once when it joins either and removed once it has left
//! both (its sequences ended before computing it, and the cache never took
//! it, or evicted it since). The chains are `block_hash.rs`'s, so a
//! consumer cannot tell an announced block from a cached one.

use std::collections::HashMap;

use super::block_hash::chain;
use super::events::{KvEvent, LoraTag, Medium};
use super::pool::Pool;
use crate::adapter::Adapter;

/// One sequence's announcement, kept with its block table (`KvBlocks`) and
/// withdrawn when the table is dropped.
#[derive(Debug)]
pub(super) struct Announced {
    adapter: Option<Adapter>,
    /// The prompt's full blocks' tokens (to find what the cache holds then).
    tokens: Vec<u32>,
    /// Index of the first announced block; `hashes` are blocks `from..`.
    from: usize,
    hashes: Vec<u64>,
}

/// The in-flight hashes, with how many live announcements name each.
#[derive(Debug, Default)]
pub(super) struct InFlight {
    counts: HashMap<u64, u32>,
}

impl InFlight {
    pub(super) fn contains(&self, hash: u64) -> bool {
        self.counts.contains_key(&hash)
    }

    /// Hashes announced and still in flight (checks and tests).
    pub(super) fn hashes(&self) -> impl Iterator<Item = u64> + '_ {
        self.counts.keys().copied()
    }
}

impl Pool {
    /// Announces the full blocks of `tokens` past what the prefix cache
    /// holds: those not already held or in flight are stored now. None
    /// where there is nothing to announce.
    pub(super) fn announce(&mut self, adapter: Option<&Adapter>, tokens: &[u32], block_size: u32) -> Option<Announced> {
        let bs = block_size as usize;
        let full = tokens.len() / bs;
        let from = self.radix.match_prefix(adapter, tokens, full, false).len();
        if from >= full {
            return None;
        }
        let all = chain(&tokens[..full * bs], bs, adapter.map(|a| a.name.as_str()));
        let fresh: Vec<bool> = all[from..].iter().map(|h| !self.in_flight.contains(*h)).collect();
        for &h in &all[from..] {
            *self.in_flight.counts.entry(h).or_insert(0) += 1;
        }
        for run in runs(&fresh) {
            let (start, end) = (from + run.start, from + run.end);
            self.events.push(KvEvent::Stored {
                hashes: all[start..end].to_vec(),
                parent: start.checked_sub(1).map(|p| all[p]),
                tokens: tokens[start * bs..end * bs].to_vec(),
                block_size,
                medium: Medium::Device,
                lora: LoraTag::of(adapter),
            });
        }
        Some(Announced {
            adapter: adapter.cloned(),
            tokens: tokens[..full * bs].to_vec(),
            from,
            hashes: all[from..].to_vec(),
        })
    }

    /// Ends an announcement: blocks no other announcement names and the
    /// prefix cache does not hold are removed, deepest first.
    pub(super) fn withdraw(&mut self, a: Announced, block_size: u32) {
        let held =
            self.radix.match_prefix(a.adapter.as_ref(), &a.tokens, a.tokens.len() / block_size as usize, false).len();
        for (i, &h) in a.hashes.iter().enumerate().rev() {
            let Some(n) = self.in_flight.counts.get_mut(&h) else { continue };
            *n -= 1;
            if *n > 0 {
                continue;
            }
            self.in_flight.counts.remove(&h);
            if a.from + i >= held {
                self.events.removed(h, Medium::Device);
            }
        }
    }
}

/// Maximal runs of `true` in `flags`.
pub(super) fn runs(flags: &[bool]) -> Vec<std::ops::Range<usize>> {
    let mut out = Vec::new();
    let mut start = None;
    for (i, &f) in flags.iter().chain(std::iter::once(&false)).enumerate() {
        match (f, start) {
            (true, None) => start = Some(i),
            (false, Some(s)) => {
                out.push(s..i);
                start = None;
            }
            _ => {}
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::runs;

    #[test]
    fn runs_are_maximal() {
        assert_eq!(runs(&[]), Vec::<std::ops::Range<usize>>::new());
        assert_eq!(runs(&[true, true, false, true]), vec![0..2, 3..4]);
        assert_eq!(runs(&[false, false]), Vec::<std::ops::Range<usize>>::new());
    }
}
