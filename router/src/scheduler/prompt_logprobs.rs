//! The prompt logprobs of one sequence that asked for them (TGI's
//! `decoder_input_details`, OpenAI's `echo` with `logprobs`, vLLM's
//! `prompt_logprobs`), gathered per position until none is missing.
//!
//! The shard reports, on each step, the positions that step's rows predict
//! (a range `num_computed..end` covers `num_computed + 1 ..= end`), so
//! chunks join without a gap. A cached prefix is not computed: its
//! positions come from the logprobs stored beside its blocks
//! (`logprob_cache.rs`), and the scheduler takes from the KV cache only as
//! much of the prompt as is covered that way, the first uncached token
//! included (`cacheable_blocks`). A reply never has a gap: the first sample
//! of a sequence whose prompt still misses a position is a `generation`
//! error, never a `null`.

use super::logprob_cache::LogprobCache;
use super::sequence::Sequence;
use crate::proto::pb;
use crate::queue::SeqEvent;

#[derive(Debug, Clone)]
pub struct PromptLogprobs {
    /// Per prompt position; NaN where not known yet (position 0 never is).
    pub logprobs: Vec<f32>,
    /// Each token's rank in the vocabulary at its position (0 where unknown).
    pub ranks: Vec<u32>,
    /// Alternatives per position when `top_n` > 0 (else empty).
    pub top: Vec<pb::Tokens>,
    pub top_n: u32,
    /// Handed to the stream (on the first sample): nothing more is asked of the shard.
    pub sent: bool,
}

impl PromptLogprobs {
    pub fn new(len: usize, top_n: u32) -> Self {
        let top = if top_n > 0 { vec![pb::Tokens::default(); len] } else { Vec::new() };
        Self { logprobs: vec![f32::NAN; len], ranks: vec![0; len], top, top_n, sent: false }
    }

    pub fn len(&self) -> usize {
        self.logprobs.len()
    }

    pub fn is_empty(&self) -> bool {
        self.logprobs.is_empty()
    }

    pub fn known(&self, pos: usize) -> bool {
        pos == 0 || self.logprobs.get(pos).is_some_and(|l| !l.is_nan())
    }

    /// Leading positions known (position 0 counts: it has no logprob to know).
    pub fn known_prefix(&self) -> usize {
        (0..self.len()).find(|&p| !self.known(p)).unwrap_or(self.len())
    }

    pub fn set(&mut self, pos: usize, logprob: f32, rank: u32, top: Option<&pb::Tokens>) {
        self.logprobs[pos] = logprob;
        self.ranks[pos] = rank;
        if let (Some(slot), Some(t)) = (self.top.get_mut(pos), top) {
            let k = self.top_n as usize;
            *slot = pb::Tokens {
                ids: t.ids.iter().take(k).copied().collect(),
                logprobs: t.logprobs.iter().take(k).copied().collect(),
            };
        }
    }

    /// One step's report. A malformed one (past the prompt, position 0,
    /// lists of different lengths, too few alternatives) is an error.
    pub fn merge(&mut self, p: &pb::PromptLogprobs) -> Result<(), String> {
        let (first, n) = (p.first as usize, p.logprobs.len());
        if first == 0 || first + n > self.len() {
            return Err(format!(
                "prompt logprobs for positions {first}..{} of a {}-token prompt",
                first + n,
                self.len()
            ));
        }
        let top_short = self.top_n > 0 && (p.top.len() != n || p.top.iter().any(|t| t.ids.len() < self.top_n as usize));
        if p.ranks.len() != n || top_short {
            return Err(format!("prompt logprobs without a rank or {} alternatives per position", self.top_n));
        }
        for i in 0..n {
            self.set(first + i, p.logprobs[i], p.ranks[i], p.top.get(i));
        }
        Ok(())
    }
}

/// Leading KV blocks of `s`'s prompt the scheduler may take from the cache:
/// any number without prompt logprobs to gather; else only blocks whose
/// positions, and the first position after them, are known (gathered, or
/// stored in `cache`): the shard predicts nothing it does not compute.
pub fn cacheable_blocks(s: &Sequence, cache: &LogprobCache, block_size: u32) -> u32 {
    let Some(lps) = s.prompt_lps.as_ref().filter(|l| !l.sent) else { return u32::MAX };
    let prompt = &s.tokens[..lps.len()];
    let stored = cache.stored_blocks(prompt, lps.top_n);
    let bs = block_size as usize;
    let known = (0..lps.len()).find(|&p| !lps.known(p) && !stored.get(p / bs).copied().unwrap_or(false));
    let known = known.unwrap_or(lps.len());
    // The first uncached position must be known too: known > blocks * bs.
    (known.saturating_sub(1) / bs) as u32
}

/// Before `s` is admitted: its gathered logprobs completed from `cache`.
pub fn fill_from_cache(s: &mut Sequence, cache: &mut LogprobCache) {
    if let Some(lps) = s.prompt_lps.as_mut().filter(|l| !l.sent) {
        cache.fill(&s.tokens[..lps.len()], lps);
    }
}

/// Folds a generation's report in; where the shard samples the first token,
/// the prompt must be complete.
pub fn take_report(s: &mut Sequence, g: &pb::Generation, samples: bool) -> Result<(), String> {
    let Some(lps) = s.prompt_lps.as_mut().filter(|l| !l.sent) else { return Ok(()) };
    if let Some(p) = &g.prompt_logprobs {
        lps.merge(p).map_err(|e| format!("request {}: {e}", s.id))?;
    }
    match lps.known_prefix() {
        k if samples && k < lps.len() => {
            Err(format!("request {}: the shard left the logprob of prompt position {k} out", s.id))
        }
        _ => Ok(()),
    }
}

/// On the first sample: the whole prompt's logprobs for the stream, stored
/// beside the prompt's blocks for later requests with the same prefix.
pub fn prefill_event(s: &mut Sequence, cache: &mut LogprobCache, caching: bool) -> Option<SeqEvent> {
    let lps = s.prompt_lps.as_mut().filter(|l| !l.sent)?;
    lps.sent = true;
    let ids = s.tokens[..lps.len()].to_vec();
    if caching {
        cache.store(&ids, lps);
    }
    Some(SeqEvent::Prefill { ids, logprobs: lps.logprobs.clone(), ranks: lps.ranks.clone(), top: lps.top.clone() })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn report(first: u32, lps: &[f32], top_n: usize) -> pb::PromptLogprobs {
        let top = if top_n == 0 {
            vec![]
        } else {
            vec![pb::Tokens { ids: vec![7; top_n], logprobs: vec![-0.1; top_n] }; lps.len()]
        };
        pb::PromptLogprobs { first, logprobs: lps.to_vec(), ranks: vec![1; lps.len()], top }
    }

    #[test]
    fn pieces_join_and_malformed_reports_are_refused() {
        let mut l = PromptLogprobs::new(6, 2);
        assert_eq!(l.known_prefix(), 1);
        l.merge(&report(1, &[-1.0, -2.0], 2)).unwrap();
        assert_eq!(l.known_prefix(), 3);
        l.merge(&report(4, &[-4.0, -5.0], 3)).unwrap();
        assert_eq!((l.known_prefix(), l.top[4].ids.len()), (3, 2));
        l.merge(&report(3, &[-3.0], 2)).unwrap();
        assert_eq!(l.known_prefix(), 6);
        for bad in [report(0, &[-1.0], 2), report(5, &[-1.0, -2.0], 2), report(1, &[-1.0], 1)] {
            assert!(l.merge(&bad).is_err(), "{bad:?}");
        }
        let mut no_rank = report(1, &[-1.0], 2);
        no_rank.ranks.clear();
        assert!(l.merge(&no_rank).is_err());
    }
}
