//! One server, one event stream: the data-parallel groups' events merged
//! into what the server as a whole holds. A block hash is announced when
//! the first group (per medium) gets it and removed when the last one drops
//! it, so a consumer that sees this server as one worker is never told a
//! prefix is gone while another group still holds it. Pure.

use std::collections::{HashMap, HashSet};

use crate::kv::{KvEvent, LoraTag, Medium};

type Held = (Medium, u64);

#[derive(Debug, Default)]
pub struct Merger {
    /// What each group holds.
    groups: Vec<HashSet<Held>>,
    /// How many groups hold each block.
    holders: HashMap<Held, u32>,
}

impl Merger {
    /// Group `group`'s events in, the server's out.
    pub fn apply(&mut self, group: usize, events: Vec<KvEvent>) -> Vec<KvEvent> {
        if self.groups.len() <= group {
            self.groups.resize_with(group + 1, HashSet::new);
        }
        let mut out = Vec::new();
        for e in events {
            match e {
                KvEvent::Stored { hashes, parent, tokens, block_size, medium, lora } => {
                    self.stored(group, &hashes, parent, &tokens, (block_size, medium, lora), &mut out)
                }
                KvEvent::Removed { hashes, medium } => {
                    let gone: Vec<u64> = hashes.into_iter().filter(|&h| self.drop_one(group, (medium, h))).collect();
                    if !gone.is_empty() {
                        out.push(KvEvent::Removed { hashes: gone, medium });
                    }
                }
                KvEvent::Cleared => self.cleared(group, &mut out),
            }
        }
        out
    }

    /// Subscribers missed events: they are told to forget everything, and so is the merger.
    pub fn reset(&mut self) -> KvEvent {
        self.groups.iter_mut().for_each(HashSet::clear);
        self.holders.clear();
        KvEvent::Cleared
    }

    /// The chain's blocks new to the server, as chains of their own.
    #[allow(clippy::too_many_arguments)]
    fn stored(
        &mut self,
        group: usize,
        hashes: &[u64],
        parent: Option<u64>,
        tokens: &[u32],
        (block_size, medium, lora): (u32, Medium, Option<LoraTag>),
        out: &mut Vec<KvEvent>,
    ) {
        let bs = block_size as usize;
        let mut run: Option<(usize, Option<u64>)> = None;
        let flush = |run: &mut Option<(usize, Option<u64>)>, end: usize, out: &mut Vec<KvEvent>| {
            if let Some((start, parent)) = run.take() {
                out.push(KvEvent::Stored {
                    hashes: hashes[start..end].to_vec(),
                    parent,
                    tokens: tokens[start * bs..(end * bs).min(tokens.len())].to_vec(),
                    block_size,
                    medium,
                    lora: lora.clone(),
                });
            }
        };
        for (i, &h) in hashes.iter().enumerate() {
            if self.add_one(group, (medium, h)) {
                run.get_or_insert((i, if i == 0 { parent } else { Some(hashes[i - 1]) }));
            } else {
                flush(&mut run, i, out);
            }
        }
        flush(&mut run, hashes.len(), out);
    }

    /// True when the server did not hold it before.
    fn add_one(&mut self, group: usize, held: Held) -> bool {
        if !self.groups[group].insert(held) {
            return false;
        }
        let n = self.holders.entry(held).or_default();
        *n += 1;
        *n == 1
    }

    /// True when no group holds it any more.
    fn drop_one(&mut self, group: usize, held: Held) -> bool {
        if !self.groups[group].remove(&held) {
            return false;
        }
        match self.holders.get_mut(&held) {
            Some(n) if *n > 1 => {
                *n -= 1;
                false
            }
            _ => {
                self.holders.remove(&held);
                true
            }
        }
    }

    fn cleared(&mut self, group: usize, out: &mut Vec<KvEvent>) {
        let held: Vec<Held> = self.groups[group].iter().copied().collect();
        let mut gone: Vec<Held> = held.into_iter().filter(|&h| self.drop_one(group, h)).collect();
        if self.holders.is_empty() {
            out.push(KvEvent::Cleared);
            return;
        }
        gone.sort();
        for medium in [Medium::Device, Medium::Host, Medium::Disk] {
            let hashes: Vec<u64> = gone.iter().filter(|h| h.0 == medium).map(|h| h.1).collect();
            if !hashes.is_empty() {
                out.push(KvEvent::Removed { hashes, medium });
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stored(hashes: &[u64], parent: Option<u64>) -> KvEvent {
        let tokens = hashes.iter().flat_map(|&h| [h as u32, h as u32]).collect();
        KvEvent::Stored { hashes: hashes.to_vec(), parent, tokens, block_size: 2, medium: Medium::Device, lora: None }
    }

    fn removed(hashes: &[u64]) -> KvEvent {
        KvEvent::Removed { hashes: hashes.to_vec(), medium: Medium::Device }
    }

    #[test]
    fn a_block_two_groups_hold_is_announced_once_and_removed_last() {
        let mut m = Merger::default();
        assert_eq!(m.apply(0, vec![stored(&[1, 2], None)]), vec![stored(&[1, 2], None)]);
        // Group 1 caches the same prompt and one more block: only that block is news.
        assert_eq!(m.apply(1, vec![stored(&[1, 2, 3], None)]), vec![stored(&[3], Some(2))]);
        assert_eq!(m.apply(0, vec![removed(&[2, 1])]), vec![]);
        assert_eq!(m.apply(1, vec![removed(&[3, 2])]), vec![removed(&[3, 2])]);
        // Removing what the group never held says nothing.
        assert_eq!(m.apply(0, vec![removed(&[9])]), vec![]);
    }

    #[test]
    fn a_gap_in_a_chain_splits_it() {
        let mut m = Merger::default();
        m.apply(1, vec![stored(&[2], Some(1))]);
        let out = m.apply(0, vec![stored(&[1, 2, 3], None)]);
        assert_eq!(out, vec![stored(&[1], None), stored(&[3], Some(2))]);
    }

    #[test]
    fn a_cleared_group_removes_only_what_it_alone_held() {
        let mut m = Merger::default();
        m.apply(0, vec![stored(&[1, 2], None)]);
        m.apply(1, vec![stored(&[1], None)]);
        assert_eq!(m.apply(0, vec![KvEvent::Cleared]), vec![removed(&[2])]);
        assert_eq!(m.apply(1, vec![KvEvent::Cleared]), vec![KvEvent::Cleared]);
        assert_eq!(m.reset(), KvEvent::Cleared);
        assert_eq!(m.apply(1, vec![stored(&[1], None)]), vec![stored(&[1], None)]);
    }
}
