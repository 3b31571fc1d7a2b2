//! The order in which queued requests are considered for admission, over
//! admission units (a request, or all forks of an `n`/`best_of` request).

use std::collections::VecDeque;
use std::ops::Range;
use std::time::Instant;

use super::sequence::Sequence;
use super::state::State;
use super::AdmissionOrder;

/// Admission order: best effective priority first (priority raised by the
/// time waited, see `Sequence::effective_priority`), then, with
/// `LongestPrefix`, the longest cached prefix, then arrival. Stable, per
/// admission unit. A preempted sequence keeps its arrival, so it is ahead of
/// every later arrival of its priority.
pub fn order_queue(st: &mut State, now: Instant) {
    let lpm = st.config.order == AdmissionOrder::LongestPrefix;
    let aging = st.config.priority_aging;
    let units = units(&st.queue);
    let keys: Vec<(i64, std::cmp::Reverse<u32>, u64)> = units
        .iter()
        .map(|u| {
            let s = &st.queue[u.start];
            let hit = if lpm { st.kv.peek_prefix(s.adapter(), &s.tokens) } else { 0 };
            (s.effective_priority(now, aging), std::cmp::Reverse(hit), s.arrival)
        })
        .collect();
    if keys.windows(2).all(|w| w[0] <= w[1]) {
        return;
    }
    let mut drained: VecDeque<Sequence> = st.queue.drain(..).collect();
    let mut keyed: Vec<(_, Vec<Sequence>)> = Vec::with_capacity(units.len());
    for (u, key) in units.iter().zip(keys) {
        keyed.push((key, drained.drain(..u.len()).collect()));
    }
    keyed.sort_by_key(|(key, _)| *key);
    st.queue = keyed.into_iter().flat_map(|(_, seqs)| seqs).collect();
}

/// Groups the queue into admission units: a request, or all forks of one
/// `n`/`best_of` request (they arrive together and go together).
pub fn units(queue: &VecDeque<Sequence>) -> Vec<Range<usize>> {
    let mut units = Vec::new();
    let mut start = 0;
    while start < queue.len() {
        let group = queue[start].group;
        let mut end = start + 1;
        while group.is_some() && end < queue.len() && queue[end].group == group {
            end += 1;
        }
        units.push(start..end);
        start = end;
    }
    units
}

/// Reorders the queue so that the units marked `held` come after the others,
/// each kind in its order; returns the units as they now lie and how many
/// unheld ones lead.
pub fn hold_back(queue: &mut VecDeque<Sequence>, units: &[Range<usize>], held: &[bool]) -> (Vec<Range<usize>>, usize) {
    let (leading, behind): (Vec<usize>, Vec<usize>) = (0..units.len()).partition(|&k| !held[k]);
    if behind.iter().enumerate().all(|(i, &k)| k == leading.len() + i) {
        // Already in that order.
        return (units.to_vec(), leading.len());
    }
    let mut drained: Vec<Option<Sequence>> = queue.drain(..).map(Some).collect();
    let mut new_units = Vec::with_capacity(units.len());
    for &k in leading.iter().chain(&behind) {
        let start = queue.len();
        for i in units[k].clone() {
            queue.push_back(drained[i].take().expect("each sequence moves once"));
        }
        new_units.push(start..queue.len());
    }
    (new_units, leading.len())
}
