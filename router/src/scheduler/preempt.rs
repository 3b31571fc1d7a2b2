//! Preemption by recompute: when a running sequence needs a block and the
//! pool (free + evictable cached prefixes) has none, the newest sequence
//! gives its blocks back. Its computed blocks go into the radix cache, so on
//! resume it recomputes only those that others have taken meanwhile.

use super::sequence::Sequence;
use super::Scheduler;

impl Scheduler {
    /// Makes room for this step's tokens of every running sequence, oldest
    /// first; returns the preempted sequences (without blocks), oldest first.
    pub(super) fn grow_or_preempt(&mut self) -> Vec<Sequence> {
        let mut order: Vec<(u64, u64)> = self.running.values().map(|s| (s.admitted_at, s.id())).collect();
        order.sort_unstable();
        let mut preempted = Vec::new();
        for &(_, id) in &order {
            loop {
                let Some(s) = self.running.get_mut(&id) else { break };
                let end = s.seq_len + 1 + self.config.speculate;
                if s.blocks.as_mut().expect("running sequence has blocks").ensure_capacity(end) {
                    break;
                }
                let victim = self
                    .running
                    .values()
                    .max_by_key(|s| s.admitted_at)
                    .map(|s| s.id())
                    .expect("the sequence being grown is running");
                preempted.push(self.preempt(victim));
                if victim == id {
                    break;
                }
            }
        }
        preempted.sort_by_key(|s| s.admitted_at);
        preempted
    }

    fn preempt(&mut self, id: u64) -> Sequence {
        let mut s = self.running.remove(&id).expect("victim is running");
        if let Some(blocks) = s.blocks.take() {
            // Computed KV goes to the cache; dropping the table releases it.
            self.kv.commit(&blocks, &s.tokens[..s.seq_len as usize]);
        }
        s.preemptions += 1;
        s.seq_len = 0;
        tracing::debug!("preempted request {id} after {} tokens", s.generated_tokens);
        s
    }
}
