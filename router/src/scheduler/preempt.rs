//! Preemption by recompute: when the pool cannot grow a running sequence
//! (or a better-priority arrival needs the room, priority_preempt.rs), a
//! victim gives its blocks back (computed ones to the prefix cache) and goes
//! back to the queue with its generated tokens, to be recomputed on resume.
//! The client never notices except in latency.

use super::sequence::Sequence;
use super::state::State;

/// Preempted sequences back to the queue; admission orders it by priority
/// and arrival, so they resume before anything that arrived after them.
pub(super) fn requeue(st: &mut State, mut preempted: Vec<Sequence>) {
    preempted.sort_by_key(|s| s.arrival);
    for s in preempted.into_iter().rev() {
        st.queue.push_front(s);
    }
}

/// Which running sequence to preempt so that `running[grow]` can grow: one
/// not yet in this step's plan (`grow` itself, those after it, or prompts
/// still under way). The worst priority goes first; among equals, the one
/// that loses the least work (fewest computed tokens to redo), then the
/// newest.
pub(super) fn victim(running: &[Sequence], grow: usize) -> usize {
    (0..running.len())
        .filter(|&j| j >= grow || !running[j].prefilled)
        .max_by_key(|&j| {
            let s = &running[j];
            (s.priority(), std::cmp::Reverse(s.num_computed), s.admitted_at)
        })
        .expect("the sequence being grown is a candidate")
}

/// Preemption by recompute: computed blocks go to the prefix cache, so on
/// resume only what others have taken meanwhile is recomputed.
pub(super) fn preempt(st: &mut State, s: Sequence) -> Sequence {
    let mut s = st.release(s, true);
    tracing::debug!("preempted request {} after {} tokens", s.id, s.generated);
    s.lost = s.num_computed;
    s.preemptions += 1;
    s.num_computed = 0;
    s.sent_blocks = 0;
    s.prefilled = false;
    if s.generated > 0 {
        // A fork that has sampled recomputes its own tokens: it resumes alone
        // (chunkable, sharing the prompt through the prefix cache), not as
        // part of an unsplittable group whose recompute may exceed any step.
        s.group = None;
    }
    s
}
