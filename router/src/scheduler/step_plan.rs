//! `StepPlan`: what one step computes, as `schedule` (or `plan_ahead`)
//! decided it: the `StepRequest` for the shards, and per scheduled range
//! what the plan promised, which `update` checks the reply against.

use super::sequence::Sequence;
use crate::error::RouterError;
use crate::proto::pb;

/// One scheduled range of one sequence, as the plan promised it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Planned {
    pub id: u64,
    pub num_computed: u32,
    pub num_tokens: u32,
    /// The range reaches the end of the known tokens: the shard samples.
    pub samples: bool,
    pub max_proposals: u32,
    /// A prompt range (the first sample of a sequence comes from one).
    pub prompt: bool,
}

/// A sequence admitted with blocks to load from the second tier: this step
/// only loads them; its compute is planned once the reply confirmed them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Loading {
    pub id: u64,
    /// Index in its block table of the first loaded block.
    pub first_block: u32,
    pub keys: Vec<String>,
}

#[derive(Debug, Default)]
pub struct StepPlan {
    /// Sequences whose blocks this step loads from the second tier.
    pub loading: Vec<Loading>,
    /// Prompt tokens those loads bring back (metrics).
    pub tier_hit_tokens: u64,
    pub planned: Vec<Planned>,
    pub request: pb::StepRequest,
    pub preempted: u32,
    /// Prompt tokens computed by this step, and prompt tokens served from
    /// the prefix cache at admission (metrics).
    pub prompt_tokens: u64,
    pub prefix_hit_tokens: u64,
    /// Sequences ended because they can never fit (see `too_large.rs`):
    /// their streams get the error, the shard is told to forget them.
    pub rejected: Vec<(u64, RouterError)>,
    /// Tokens resumed sequences compute again, their KV lost to preemption.
    pub recomputed_tokens: u64,
}

impl StepPlan {
    /// Nothing to compute or load (finished ids and tier saves may still need telling).
    pub fn is_empty(&self) -> bool {
        self.planned.is_empty() && self.loading.is_empty()
    }

    /// A step worth sending even with nothing to compute.
    pub fn has_messages(&self) -> bool {
        let r = &self.request;
        !(r.finished_ids.is_empty() && r.kv_saves.is_empty() && r.kv_deletes.is_empty())
    }

    pub fn has_decode(&self) -> bool {
        self.planned.iter().any(|p| !p.prompt)
    }

    pub(super) fn push(&mut self, s: &mut Sequence, num_tokens: u32, max_proposals: u32, prompt: bool) {
        let ids = s.blocks.as_ref().map_or(&[][..], |b| b.ids());
        let from = if s.on_shard { s.sent_blocks.min(ids.len()) } else { 0 };
        let new_request = (!s.on_shard).then(|| s.new_request());
        self.request.requests.push(pb::ScheduledRequest {
            id: s.id,
            new_request,
            num_computed: s.num_computed,
            num_tokens,
            new_block_ids: ids[from..].to_vec(),
            max_proposals,
        });
        s.sent_blocks = ids.len();
        s.on_shard = true;
        if prompt {
            self.prompt_tokens += num_tokens as u64;
            // The part of this range a preemption had computed before.
            let redo = s.lost.min(s.num_computed + num_tokens).saturating_sub(s.num_computed);
            self.recomputed_tokens += redo as u64;
        }
        self.planned.push(Planned {
            id: s.id,
            num_computed: s.num_computed,
            num_tokens,
            samples: s.num_computed + num_tokens == s.len(),
            max_proposals,
            prompt,
        });
    }
}
