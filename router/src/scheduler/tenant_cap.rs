//! Per-tenant cap on running requests (`--max-running-per-tenant`), so that
//! one client flooding the queue cannot take every seat of the batch while
//! others wait behind it. A tenant is whatever the request names
//! (`user` on the OpenAI and TGI routes); requests without one are not capped.

use std::collections::HashMap;
use std::collections::VecDeque;
use std::ops::Range;

use super::order::hold_back;
use super::sequence::Sequence;

/// Reorders the queue units (given in admission order) so that those whose
/// tenant is at its cap come last, and returns how many units lead that may
/// be admitted now. The held units keep their relative order, and their
/// place next step (admission re-sorts the queue every time). A unit larger
/// than the cap may still run when its tenant has nothing running.
pub fn hold_back_capped(
    queue: &mut VecDeque<Sequence>,
    running: &[Sequence],
    units: &[Range<usize>],
    cap: u32,
) -> (Vec<Range<usize>>, usize) {
    let mut count: HashMap<&str, u32> = HashMap::new();
    for s in running {
        if let Some(t) = s.request.tenant.as_deref() {
            *count.entry(t).or_default() += 1;
        }
    }
    let mut ok = vec![true; units.len()];
    for (k, u) in units.iter().enumerate() {
        let Some(t) = queue[u.start].request.tenant.as_deref() else { continue };
        let n = count.entry(t).or_default();
        if *n == 0 || *n + u.len() as u32 <= cap {
            *n += u.len() as u32;
        } else {
            ok[k] = false;
        }
    }
    let held: Vec<bool> = ok.iter().map(|o| !o).collect();
    hold_back(queue, units, &held)
}
