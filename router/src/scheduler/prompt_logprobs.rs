//! The prompt logprobs of one sequence that asked for them (TGI's
//! `decoder_input_details`, OpenAI's `echo` with `logprobs`, vLLM's
//! `prompt_logprobs`), per position, as they come: from the shard's
//! reports (a range `num_computed..end` covers `num_computed + 1 ..= end`,
//! so chunks join without a gap) and from the logprobs stored beside the
//! prefix cache's blocks (`logprob_cache.rs`). How they are gathered:
//! `logprob_gather.rs`.

use crate::proto::pb;

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
