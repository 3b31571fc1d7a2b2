//! Chunked prefill: a long prompt is prefilled over several steps, at most
//! `prefill_chunk_tokens` per step, with a decode step of the running batch
//! between chunks, so streams already running keep getting tokens while a
//! long prompt is computed (lower ITL under load; shorter prompts behind it
//! get their first token sooner).
//!
//! No new shard call: a chunk is an ordinary Prefill of the prompt's first
//! `end` tokens with `cache_len` = the tokens computed by earlier chunks (the
//! mechanism a cached prefix uses). An intermediate chunk asks for one new
//! token, so the shard finishes it on length and keeps nothing; the router
//! ignores that token. The last chunk is the real prefill: it carries the
//! request's own parameters and samples its first token, exactly as an
//! unchunked prefill with that cache_len would. The prompt's blocks are all
//! allocated at admission, so a partial prompt never needs more.

use super::sequence::Sequence;
use crate::proto::pb;

/// A prompt whose prefill is under way: `done` of its tokens have KV on the shard.
pub(super) struct Partial {
    pub seq: Sequence,
    pub done: u32,
}

/// The Prefill request of an intermediate chunk: tokens [cache_len, end) of
/// `seq`, nothing sampled that anyone keeps.
pub(super) fn intermediate_chunk(seq: &Sequence, cache_len: u32, end: u32) -> pb::Request {
    let blocks = seq.blocks.as_ref().expect("a chunked sequence holds its prompt blocks");
    pb::Request {
        id: seq.id(),
        input_ids: seq.tokens[..end as usize].to_vec(),
        cache_len,
        block_table: blocks.ids().to_vec(),
        slots: blocks.slots(cache_len, end),
        // Greedy, no penalties, no grammar: the cheapest sampling, and
        // nothing that could fail for this request alone.
        parameters: Some(pb::NextTokenChooserParameters {
            temperature: 1.0,
            top_p: 1.0,
            typical_p: 1.0,
            repetition_penalty: 1.0,
            ..Default::default()
        }),
        stopping_parameters: Some(pb::StoppingCriteriaParameters {
            max_new_tokens: 1,
            ignore_eos_token: true,
            ..Default::default()
        }),
        top_n_tokens: 0,
        prefill_logprobs: false,
        generated_len: 0,
        grammar: None,
    }
}
