"""Draft-model proposer: a small model with the target's tokenizer, inside the shard.

The draft keeps its own KV pool with the same number of blocks and block size
as the target's, addressed by the same block tables: the router's block ids
index both pools, so no allocation protocol changes. Every target prefill is
mirrored by a draft prefill over the same slots, so a block the router
caches holds valid KV in both pools.

Per request, draft_len counts the leading tokens whose draft KV is valid.
A decode step first catches the draft up (the tokens the target accepted
since it last ran: one or two), then runs it autoregressively for k steps,
sampling each proposal from q (the request's own controls applied to the
draft's logits, its own generator). Only positions the router gave slots
for are written (seq_len - 1 .. seq_len - 2 + k).
"""

from __future__ import annotations

from typing import Sequence

import torch

from pagemill.attention.metadata import make_metadata
from pagemill.models.config import ModelConfig
from pagemill.models.llama import LlamaForCausalLM
from pagemill.sampling.sampler import Sampler
from pagemill.shard.kv_pool import KVPool


class DraftProposer:
    def __init__(self, model: LlamaForCausalLM, config: ModelConfig, device, block_size: int) -> None:
        self.model, self.config = model, config
        self.device, self.block_size = torch.device(device), block_size
        self.dtype = next(model.parameters()).dtype
        self.pool: KVPool | None = None

    def allocate(self, num_blocks: int) -> None:
        self.pool = KVPool.with_blocks(
            self.config, num_blocks=num_blocks, block_size=self.block_size, dtype=self.dtype, device=self.device
        )

    def forward(self, input_ids, positions, meta) -> torch.Tensor:
        return self.model(input_ids, positions, meta, self.pool.kv_caches)

    def _slot(self, table: Sequence[int], pos: int) -> int:
        return table[pos // self.block_size] * self.block_size + pos % self.block_size

    @torch.inference_mode()
    def propose(
        self, sampler: Sampler, requests: Sequence, ks: Sequence[int]
    ) -> tuple[list[list[int]], torch.Tensor | None]:
        """Up to ks[i] proposals for requests[i]; returns them and q [R, K, V] (zeros where unused)."""
        num, width = len(requests), max(ks, default=0)
        proposals: list[list[int]] = [[] for _ in requests]
        if width == 0:
            return proposals, None
        q = torch.zeros((num, width, self.config.vocab_size), device=self.device)
        active = [i for i in range(num) if ks[i] > 0]
        # Step 1: catch up on everything since draft_len, ending at the last sampled token.
        ids, positions, slots, last = [], [], [], []
        for i in active:
            r = requests[i]
            start = min(r.draft_len, r.seq_len - 1)
            ids += r.token_ids[start:]
            positions += range(start, r.seq_len)
            slots += [self._slot(r.block_table, p) for p in range(start, r.seq_len)]
            last.append(len(ids) - 1)
        meta = make_metadata(
            is_prefill=True,
            query_lens=[requests[i].seq_len - min(requests[i].draft_len, requests[i].seq_len - 1) for i in active],
            kv_lens=[requests[i].seq_len for i in active],
            block_tables=[requests[i].block_table for i in active],
            slot_mapping=slots,
            device=self.device,
        )
        hidden = self.forward(self._t(ids), self._t(positions), meta)[self._t(last)]
        for step in range(width):
            rows = [requests[i] for i in active]
            shaped = sampler.shape(self.model.compute_logits(hidden), rows)
            probs = sampler.target_probs(shaped, rows)
            tokens = sampler.draw(probs, rows).tolist()
            q[torch.tensor(active, device=self.device), step] = probs
            for j, i in enumerate(active):
                proposals[i].append(tokens[j])
            keep = [j for j, i in enumerate(active) if ks[i] > step + 1]
            if not keep:
                break
            # Next draft step: feed the proposal just drawn (decode, one token each).
            active = [active[j] for j in keep]
            pos = [requests[i].seq_len + step for i in active]
            meta = make_metadata(
                is_prefill=False,
                query_lens=[1] * len(active),
                kv_lens=[p + 1 for p in pos],
                block_tables=[requests[i].block_table for i in active],
                slot_mapping=[self._slot(requests[i].block_table, p) for i, p in zip(active, pos)],
                device=self.device,
            )
            fed = [proposals[i][-1] for i in active]
            hidden = self.forward(self._t(fed), self._t(pos), meta)
        return proposals, q

    def _t(self, x) -> torch.Tensor:
        return torch.tensor(x, dtype=torch.int64, device=self.device)
