"""Warmup helpers of ModelRunner: KV pool sizing (target and draft) and the dummy steps
that exercise the largest prefill, the widest decode and verification.

They take the runner as `self`, being its methods moved out for length.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from pagemill.attention.metadata import make_metadata
from pagemill.sampling.params import SamplingParams
from pagemill.shard.kv_pool import SCRATCH_BLOCK, KVPool
from pagemill.speculative.verify import verify

if TYPE_CHECKING:
    from pagemill.shard.engine import ModelRunner


@dataclass
class _WarmupRow:  # a SamplingRow for the dummy decode of warmup
    params: SamplingParams
    generator: None = None
    penalties: None = None
    top_n: int = 0



def allocate_pools(self: "ModelRunner", budget: int) -> None:
    """Target pool (and the draft's, with the same block count: one set of block ids
    addresses both) from a byte budget."""
    per_block = KVPool.bytes_per_block(self.config, self.block_size, self.kv_dtype, self.model.num_kv_heads)
    if self.draft is not None:
        per_block += KVPool.bytes_per_block(self.draft.config, self.block_size, self.draft.dtype)
    # Tensor-parallel ranks may hold different KV head counts (uneven splits) or
    # memory: the router addresses every rank's pool with one set of block ids,
    # so all take the smallest count. Before the check below, so that no rank
    # raises while the others wait in the collective.
    num_blocks = self.group.all_reduce_min(max(budget, 0) // per_block)
    if num_blocks < 2:
        raise ValueError(
            f"KV cache budget of {budget} bytes holds {num_blocks} blocks of {per_block} bytes; "
            "need at least 2 (block 0 is scratch)"
        )
    self.pool = KVPool.with_blocks(
        self.config, num_blocks=num_blocks, block_size=self.block_size, dtype=self.kv_dtype, device=self.device,
        num_kv_heads=self.model.num_kv_heads, huge_pages=self.huge_pages,
    )  # fmt: skip
    if self.draft is not None:
        self.draft.allocate(num_blocks)

def cuda_budget(self: "ModelRunner", req) -> int:
    # Peak activation memory is measured with one-block (scratch) pools,
    # then the real pools take what is left of the utilisation budget.
    self.pool = KVPool.with_blocks(
        self.config, num_blocks=1, block_size=self.block_size, dtype=self.kv_dtype, device=self.device,
        num_kv_heads=self.model.num_kv_heads,
    )  # fmt: skip
    if self.draft is not None:
        self.draft.allocate(1)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(self.device)
    dummy_steps(self, req)
    torch.cuda.synchronize(self.device)
    peak_extra = torch.cuda.max_memory_allocated(self.device) - torch.cuda.memory_allocated(self.device)
    self.pool = None
    if self.draft is not None:
        self.draft.pool = None
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(self.device)
    return int(total * self.gpu_memory_utilization) - (total - free) - peak_extra

@torch.inference_mode()
def dummy_steps(self: "ModelRunner", req) -> None:
    """The largest prefill the router will send, then the widest decode, all in scratch block 0."""
    bs, vocab = self.block_size, self.config.vocab_size
    total, longest = req.max_batch_prefill_tokens, min(req.max_input_tokens, req.max_batch_prefill_tokens)
    lens = [longest] * (total // longest) + ([total % longest] if total % longest else [])
    meta = make_metadata(
        is_prefill=True, query_lens=lens, kv_lens=lens,
        block_tables=[[SCRATCH_BLOCK] * math.ceil(n / bs) for n in lens],
        slot_mapping=[SCRATCH_BLOCK * bs + i % bs for n in lens for i in range(n)], device=self.device,
    )  # fmt: skip
    ids = torch.arange(total, device=self.device) % vocab
    positions = torch.cat([torch.arange(n, device=self.device) for n in lens])
    hidden = self.model(ids, positions, meta, self.pool.kv_caches)
    if self.draft is not None:
        self.draft.forward(ids, positions, meta)
    last = torch.tensor(lens, device=self.device).cumsum(0) - 1
    self.sampler(self.model.compute_logits(hidden[last]), [_WarmupRow(SamplingParams())] * len(lens))

    b = max(1, req.max_batch_size)
    meta = make_metadata(
        is_prefill=False, query_lens=[1] * b, kv_lens=[1] * b, block_tables=[[SCRATCH_BLOCK]] * b,
        slot_mapping=[SCRATCH_BLOCK * bs] * b, device=self.device,
    )  # fmt: skip
    zeros = torch.zeros(b, dtype=torch.int64, device=self.device)
    hidden = self.model(zeros, zeros, meta, self.pool.kv_caches)
    # Sampling rows exercise the sort-based warpers at full batch width.
    row = _WarmupRow(SamplingParams(temperature=0.7, top_k=50, top_p=0.9, do_sample=True))
    self.sampler(self.model.compute_logits(hidden), [row] * b)
    if self.speculate > 0:
        # The widest verification: K + 1 rows of logits per sequence, through the verifier.
        k = self.speculate
        logits = self.model.compute_logits(hidden).repeat_interleave(k + 1, dim=0)
        probs = self.sampler.target_probs(self.sampler.shape(logits, [row] * len(logits)), [row] * len(logits))
        draft_q = probs.view(b, k + 1, -1)[:, :k] if self.draft is not None else None
        verify(self.sampler, probs, [k + 1] * b, [[0] * k] * b, [row] * b, draft_q)
