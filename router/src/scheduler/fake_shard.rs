//! A shard for scheduler tests that keeps the Step contract strictly and
//! checks the router's KV bookkeeping: its "pool" stores, per slot, the
//! token whose KV was written there, and every computed range must read a
//! context whose slots hold exactly the sequence's tokens (so a wrong block
//! table, a fork reading unwritten blocks or a lost rollback shows up).
//! Sampling is a deterministic function of the context, so a recomputed
//! (preempted) sequence produces the same tokens as an undisturbed one.

use std::collections::HashMap;

use crate::proto::pb;

pub const EOS: u32 = 2;
pub const VOCAB: u32 = 97;
const GARBAGE: u32 = u32::MAX;

#[derive(Debug)]
struct Req {
    tokens: Vec<u32>,
    computed: u32,
    table: Vec<u32>,
    max_new: u32,
    generated: u32,
    ignore_eos: bool,
    /// With prefill_logprobs: the prompt's length and the alternatives asked for.
    prompt_lps: Option<(u32, u32)>,
}

pub struct FakeShard {
    pub block_size: u32,
    pub num_blocks: u32,
    slots: HashMap<u64, u32>,
    reqs: HashMap<u64, Req>,
    /// Speculative proposals accepted per decode step (of max_proposals).
    pub accept: u32,
    /// Every layer's sliding window (0: global): a range's first query reads
    /// only the keys from num_computed + 1 - window on, so only those are checked.
    pub window: u32,
    /// Every step the shard saw (for assertions on the plans).
    pub steps: Vec<pb::StepRequest>,
    /// Second tier: key -> the slots of one block, as saved.
    pub store: HashMap<String, Vec<Option<u32>>>,
    /// Keys whose file a test corrupted: loading them fails.
    pub corrupt: std::collections::HashSet<String>,
    /// A prompt position whose logprob the shard leaves out of its reports (a broken shard).
    pub omit_prompt_position: Option<u32>,
}

/// The "model"'s logprob of `token` after `context`, its rank, and the alternatives there.
pub fn prompt_logprob(context: &[u32], token: u32, top_n: u32) -> (f32, u32, pb::Tokens) {
    let h = context.iter().fold(7u64, |h, &t| h.wrapping_mul(131).wrapping_add(t as u64 + 3));
    let lp = -(((h + token as u64) % 997) as f32 + 1.0) / 100.0;
    let ids = (0..top_n).map(|k| (next_token(context) + k) % VOCAB).collect();
    let logprobs = (0..top_n).map(|k| -0.01 * (k + 1) as f32).collect();
    (lp, 1 + token % 5, pb::Tokens { ids, logprobs })
}

/// The "model": the next token after `context`.
pub fn next_token(context: &[u32]) -> u32 {
    let h = context.iter().fold(17u64, |h, &t| h.wrapping_mul(31).wrapping_add(t as u64 + 1));
    (h % VOCAB as u64) as u32
}

impl FakeShard {
    pub fn new(block_size: u32, num_blocks: u32) -> Self {
        Self {
            block_size,
            num_blocks,
            slots: HashMap::new(),
            reqs: HashMap::new(),
            accept: 0,
            window: 0,
            steps: Vec::new(),
            store: HashMap::new(),
            corrupt: Default::default(),
            omit_prompt_position: None,
        }
    }

    pub fn holds(&self, id: u64) -> bool {
        self.reqs.contains_key(&id)
    }

    pub fn held(&self) -> usize {
        self.reqs.len()
    }

    fn slot(&self, table: &[u32], pos: u32) -> u64 {
        let b = table[(pos / self.block_size) as usize];
        assert!(b > 0 && b < self.num_blocks, "block id {b} out of range");
        b as u64 * self.block_size as u64 + (pos % self.block_size) as u64
    }

    pub fn step(&mut self, req: &pb::StepRequest) -> pb::StepResponse {
        self.steps.push(req.clone());
        for id in &req.finished_ids {
            self.reqs.remove(id);
        }
        let failed_loads = self.tier_ops(req);
        let mut seen = std::collections::HashSet::new();
        for r in &req.requests {
            assert!(seen.insert(r.id), "request {} scheduled twice in one step", r.id);
            if let Some(n) = &r.new_request {
                let stop = n.stopping_parameters.clone().unwrap_or_default();
                self.reqs.insert(
                    r.id,
                    Req {
                        tokens: n.input_ids.clone(),
                        computed: r.num_computed,
                        table: Vec::new(),
                        max_new: stop.max_new_tokens,
                        generated: 0,
                        ignore_eos: stop.ignore_eos_token,
                        prompt_lps: n
                            .prefill_logprobs
                            .then(|| (n.input_ids.len() as u32 - n.generated_len, n.prompt_top_n)),
                    },
                );
            }
        }
        // Writes first (every layer writes all packed tokens before any
        // attention reads), then the reads and the samples.
        let mut fed: Vec<(u64, u32, u32)> = Vec::new(); // id, from, proposals written
        let mut errors: HashMap<u64, String> = HashMap::new();
        for r in &req.requests {
            let Some(q) = self.reqs.get_mut(&r.id) else {
                errors.insert(r.id, format!("unknown request {}", r.id));
                continue;
            };
            if q.computed != r.num_computed {
                errors.insert(r.id, format!("num_computed {} but the shard computed {}", r.num_computed, q.computed));
                continue;
            }
            q.table.extend_from_slice(&r.new_block_ids);
            let end = r.num_computed + r.num_tokens;
            assert!(r.num_tokens >= 1 && end as usize <= q.tokens.len(), "range past the known tokens");
            let decode = end as usize == q.tokens.len() && r.max_proposals > 0;
            let props = if decode { r.max_proposals.min(q.max_new.saturating_sub(q.generated + 1)) } else { 0 };
            let need = if decode { end + r.max_proposals } else { end };
            assert!(
                need as usize <= q.table.len() * self.block_size as usize,
                "request {}: block table too short",
                r.id
            );
            let table = q.table.clone();
            let tokens = q.tokens.clone();
            let mut ctx = tokens[..end as usize].to_vec();
            for pos in r.num_computed..end {
                let s = self.slot(&table, pos);
                self.slots.insert(s, tokens[pos as usize]);
            }
            // Proposals: the true continuation for the accepted ones, garbage after.
            for k in 0..props {
                let s = self.slot(&table, end + k);
                let t = next_token(&ctx);
                ctx.push(t);
                self.slots.insert(s, if k < self.accept { t } else { GARBAGE });
            }
            fed.push((r.id, end, props));
        }
        let mut generations = Vec::new();
        for r in &req.requests {
            if let Some(e) = errors.remove(&r.id) {
                self.reqs.remove(&r.id);
                generations.push(pb::Generation { request_id: r.id, error: e, ..Default::default() });
                continue;
            }
            let &(_, end, props) = fed.iter().find(|f| f.0 == r.id).expect("fed");
            let q = self.reqs.get(&r.id).expect("known");
            let first = if self.window > 0 { (r.num_computed + 1).saturating_sub(self.window) } else { 0 };
            for pos in first..end {
                let s = self.slot(&q.table, pos);
                assert_eq!(
                    self.slots.get(&s).copied(),
                    Some(q.tokens[pos as usize]),
                    "request {}: slot of position {pos} does not hold its token",
                    r.id
                );
            }
            let prompt_logprobs = self.prompt_report(r, q);
            if end as usize != q.tokens.len() {
                let q = self.reqs.get_mut(&r.id).expect("known");
                q.computed = end;
                generations.push(pb::Generation { request_id: r.id, prompt_logprobs, ..Default::default() });
                continue;
            }
            let q = self.reqs.get_mut(&r.id).expect("known");
            let mut ids = Vec::new();
            let mut finish = pb::FinishReason::Unspecified;
            for _ in 0..1 + props.min(self.accept) {
                let t = next_token(&q.tokens);
                q.tokens.push(t);
                q.generated += 1;
                ids.push(t);
                if t == EOS && !q.ignore_eos {
                    finish = pb::FinishReason::EosToken;
                } else if q.generated >= q.max_new {
                    finish = pb::FinishReason::Length;
                }
                if finish != pb::FinishReason::Unspecified {
                    break;
                }
            }
            q.computed = end + ids.len() as u32 - 1;
            let n = ids.len();
            if finish != pb::FinishReason::Unspecified {
                self.reqs.remove(&r.id);
            }
            generations.push(pb::Generation {
                request_id: r.id,
                tokens: Some(pb::Tokens { ids, logprobs: vec![-0.5; n] }),
                finish_reason: finish as i32,
                prompt_logprobs,
                ..Default::default()
            });
        }
        pb::StepResponse {
            generations,
            forward_ns: 1,
            total_ns: 1,
            kv_failed_loads: failed_loads,
            ..Default::default()
        }
    }

    /// The prompt positions a range's rows predict: `num_computed + 1 ..= end`,
    /// within the prompt (short of `omit_prompt_position`).
    fn prompt_report(&self, r: &pb::ScheduledRequest, q: &Req) -> Option<pb::PromptLogprobs> {
        let (len, top_n) = q.prompt_lps?;
        let first = r.num_computed + 1;
        let mut end = (r.num_computed + r.num_tokens).min(len - 1);
        if let Some(o) = self.omit_prompt_position.filter(|o| (first..=end).contains(o)) {
            end = o - 1;
        }
        let mut out = pb::PromptLogprobs { first, ..Default::default() };
        for pos in first..=end {
            let (lp, rank, top) = prompt_logprob(&q.tokens[..pos as usize], q.tokens[pos as usize], top_n);
            out.logprobs.push(lp);
            out.ranks.push(rank);
            if top_n > 0 {
                out.top.push(top);
            }
        }
        Some(out)
    }

    /// Saves (before anything of this step writes), loads, deletes; returns the failed loads.
    fn tier_ops(&mut self, req: &pb::StepRequest) -> Vec<String> {
        let bs = self.block_size as u64;
        let block_slots = |b: u32| b as u64 * bs..(b as u64 + 1) * bs;
        for sv in &req.kv_saves {
            let content = block_slots(sv.block_id).map(|s| self.slots.get(&s).copied()).collect();
            self.corrupt.remove(&sv.key);
            self.store.insert(sv.key.clone(), content);
        }
        let mut failed = Vec::new();
        for ld in &req.kv_loads {
            match self.store.get(&ld.key) {
                Some(c) if !self.corrupt.contains(&ld.key) => {
                    for (s, t) in block_slots(ld.block_id).zip(c.clone()) {
                        match t {
                            Some(t) => self.slots.insert(s, t),
                            None => self.slots.remove(&s),
                        };
                    }
                }
                _ => failed.push(ld.key.clone()),
            }
        }
        for k in &req.kv_deletes {
            self.store.remove(k);
        }
        failed
    }
}
