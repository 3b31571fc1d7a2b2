//! Continuous batching in the plan/execute split of vLLM v1: `schedule`
//! (schedule.rs) decides what the next step computes as a `StepPlan`
//! (step_plan.rs), the batching loop (batching/) sends that one `Step` to
//! the shards, and `update` (update.rs) applies the reply and yields token
//! events for the requests' streams. Both decisions are pure functions over
//! `State` (state.rs), unit-tested against a fake shard (tests.rs); the
//! scheduler does no I/O and deals in token ids only.

pub mod admission;
mod ahead;
#[cfg(test)]
mod fake_shard;
mod in_flight;
pub mod logprob_cache;
mod logprob_gather;
pub mod lora_cap;
mod order;
mod preempt;
mod priority_preempt;
pub mod prompt_logprobs;
mod prompts;
mod schedule;
pub mod sequence;
pub mod state;
pub mod step_plan;
mod tenant_cap;
#[cfg(test)]
mod tests;
#[cfg(test)]
mod tests_ahead;
#[cfg(test)]
mod tests_in_flight;
#[cfg(test)]
mod tests_lora;
#[cfg(test)]
mod tests_priority;
#[cfg(test)]
mod tests_priority_preempt;
#[cfg(test)]
mod tests_prompt_logprobs;
#[cfg(test)]
mod tests_requeue;
#[cfg(test)]
mod tests_tier;
pub mod too_large;
pub mod update;

pub use ahead::{plan_ahead, AHEAD_FROM_SEQUENCES};
pub use schedule::schedule;
pub use sequence::Sequence;
pub use state::State;
pub use step_plan::StepPlan;
pub use update::{is_terminal, update, Event};

use admission::Budget;

/// Order in which queued requests are considered for admission.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AdmissionOrder {
    /// Arrival order.
    Fifo,
    /// Longest cached prefix first (SGLang's LPM): more prefix hits while the
    /// shared blocks are still cached, at some cost in fairness.
    LongestPrefix,
}

#[derive(Debug, Clone, Copy)]
pub struct SchedulerConfig {
    pub budget: Budget,
    /// Proposals per decode step; each decode keeps room for speculate + 1 positions.
    pub speculate: u32,
    pub order: AdmissionOrder,
    /// Mixed steps: decode tokens plus prompt chunks up to this many tokens
    /// per step; `None`: prefill and decode steps alternate.
    pub max_num_batched_tokens: Option<u32>,
    /// Waiting this long raises a queued request's priority by one (its
    /// starvation bound); None: no aging.
    pub priority_aging: Option<std::time::Duration>,
    /// Most sequences one tenant may have running at once; None: no cap.
    pub max_running_per_tenant: Option<u32>,
    /// Most distinct LoRA adapters among the running sequences (`--max-loras`).
    pub max_loras: u32,
    /// The model's window when every layer slides (0: some layer is global):
    /// blocks wholly behind it go back to the pool while a sequence runs.
    pub sliding_window: u32,
    /// Send the next decode step before the reply of the one in flight when that step has at
    /// least this many sequences (ahead.rs); 0: never.
    pub schedule_ahead_from: u32,
}
