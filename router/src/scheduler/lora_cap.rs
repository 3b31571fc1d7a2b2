//! `--max-loras`: the shards hold at most that many adapters at once, so no
//! step may run sequences of more distinct adapters. A queued unit whose
//! adapter is not running and would be one too many waits (it is not
//! refused) and moves behind the others for this step, so requests for the
//! base model or for adapters already running are not blocked behind it. It
//! is admitted once a running adapter's last sequence ends.

use std::collections::{BTreeSet, VecDeque};
use std::ops::Range;

use super::order::hold_back;
use super::sequence::Sequence;

/// Which units (given by their adapter id in admission order, 0 for the
/// base model) must wait, with `running` the adapter ids of the running
/// sequences and at most `max` distinct adapters at once. Pure: every
/// leading run of the units it lets through keeps the step within `max`.
pub fn held_by_lora_cap(running: impl IntoIterator<Item = u32>, units: &[u32], max: u32) -> Vec<bool> {
    let mut resident: BTreeSet<u32> = running.into_iter().filter(|&id| id != 0).collect();
    units
        .iter()
        .map(|&id| {
            if id == 0 || resident.contains(&id) {
                return false;
            }
            if (resident.len() as u32) < max {
                resident.insert(id);
                return false;
            }
            true
        })
        .collect()
}

/// Moves the leading `eligible` units that must wait for an adapter slot
/// behind the others; returns the units as they now lie and how many lead
/// eligible.
pub(super) fn hold_back_lora(
    queue: &mut VecDeque<Sequence>,
    running: &[Sequence],
    units: &[Range<usize>],
    eligible: usize,
    max: u32,
) -> (Vec<Range<usize>>, usize) {
    let ids: Vec<u32> = units[..eligible].iter().map(|u| queue[u.start].adapter_id()).collect();
    let mut held = held_by_lora_cap(running.iter().map(Sequence::adapter_id), &ids, max);
    if held.iter().all(|h| !h) {
        return (units.to_vec(), eligible);
    }
    held.resize(units.len(), true);
    hold_back(queue, units, &held)
}

/// Whether a unit of adapter `id` can run now beside `running`.
pub fn lora_fits(running: &[Sequence], id: u32, max: u32) -> bool {
    !held_by_lora_cap(running.iter().map(Sequence::adapter_id), &[id], max)[0]
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    #[test]
    fn a_new_adapter_waits_only_when_the_slots_are_taken() {
        // Running: adapters 1 and 2; max 2. Adapter 3 waits, 1 and the base go.
        assert_eq!(held_by_lora_cap([1, 2, 0], &[3, 1, 0, 2, 3], 2), [true, false, false, false, true]);
        // A free slot goes to the first new adapter in order; the next new one waits.
        assert_eq!(held_by_lora_cap([1], &[2, 3, 2, 0], 2), [false, true, false, false]);
        // Nothing running: the first `max` distinct adapters go.
        assert_eq!(held_by_lora_cap([], &[5, 6, 7, 5, 7], 2), [false, false, true, false, true]);
        // The base model needs no slot.
        assert_eq!(held_by_lora_cap([1, 2], &[0, 0], 2), [false, false]);
    }

    proptest! {
        /// Whatever the queue, the units let through plus those running use
        /// at most `max` adapters (counted over every leading run, as
        /// admission takes a prefix of them); none is held while it could
        /// run (its adapter resident, the base model, or a slot free at its
        /// turn); and the units let through keep their order.
        #[test]
        fn never_more_than_max_adapters_and_nobody_held_for_nothing(
            running in proptest::collection::vec(0u32..6, 0..8),
            units in proptest::collection::vec(0u32..8, 0..24),
            max in 1u32..5,
        ) {
            let distinct_running: BTreeSet<u32> = running.iter().copied().filter(|&i| i != 0).collect();
            prop_assume!(distinct_running.len() as u32 <= max);
            let held = held_by_lora_cap(running.iter().copied(), &units, max);
            prop_assert_eq!(held.len(), units.len());
            let mut resident = distinct_running.clone();
            for (k, &id) in units.iter().enumerate() {
                if held[k] {
                    prop_assert!(id != 0, "the base model never waits for a slot");
                    prop_assert!(!resident.contains(&id), "unit {} held with its adapter resident", k);
                    prop_assert_eq!(resident.len() as u32, max, "unit {} held with a slot free", k);
                } else if id != 0 {
                    resident.insert(id);
                }
                prop_assert!(resident.len() as u32 <= max, "{} adapters after unit {}", resident.len(), k);
            }
        }
    }
}
