//! A sequence's prompt logprobs gathered without a gap. A cached prefix is
//! not computed: its positions come from the logprobs stored beside its
//! blocks (`logprob_cache.rs`), and the scheduler takes from the KV cache
//! only as much of the prompt as is covered that way, the first uncached
//! token included (`cacheable_blocks`). The shard reports the rest step by
//! step (`take_report`). A reply never has a gap: the first sample of a
//! sequence whose prompt still misses a position is a `generation` error,
//! never a `null`.

use super::logprob_cache::LogprobCache;
use super::sequence::Sequence;
use crate::proto::pb;
use crate::queue::SeqEvent;

/// Leading KV blocks of `s`'s prompt the scheduler may take from the cache:
/// any number without prompt logprobs to gather; else only blocks whose
/// positions, and the first position after them, are known (gathered, or
/// stored in `cache`): the shard predicts nothing it does not compute.
pub fn cacheable_blocks(s: &Sequence, cache: &LogprobCache, block_size: u32) -> u32 {
    let Some(lps) = s.prompt_lps.as_ref().filter(|l| !l.sent) else { return u32::MAX };
    let prompt = &s.tokens[..lps.len()];
    let stored = cache.stored_blocks(s.adapter_id(), prompt, lps.top_n);
    let bs = block_size as usize;
    let known = (0..lps.len()).find(|&p| !lps.known(p) && !stored.get(p / bs).copied().unwrap_or(false));
    let known = known.unwrap_or(lps.len());
    // The first uncached position must be known too: known > blocks * bs.
    (known.saturating_sub(1) / bs) as u32
}

/// Before `s` is admitted: its gathered logprobs completed from `cache`.
pub fn fill_from_cache(s: &mut Sequence, cache: &mut LogprobCache) {
    let lora = s.adapter_id();
    if let Some(lps) = s.prompt_lps.as_mut().filter(|l| !l.sent) {
        cache.fill(lora, &s.tokens[..lps.len()], lps);
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
    let lora = s.adapter_id();
    let lps = s.prompt_lps.as_mut().filter(|l| !l.sent)?;
    lps.sent = true;
    let ids = s.tokens[..lps.len()].to_vec();
    if caching {
        cache.store(lora, &ids, lps);
    }
    Some(SeqEvent::Prefill { ids, logprobs: lps.logprobs.clone(), ranks: lps.ranks.clone(), top: lps.top.clone() })
}
