"""ModelRunner's Warmup (run_warmup) and its helpers: KV pool sizing (target and draft) and the
dummy steps that exercise the largest prefill, the widest decode and verification.

They take the runner as `self`, being its methods moved out for length.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import grpc
import torch

from pagemill.attention.kv_dtype import kv_dtype_name
from pagemill.attention.metadata import make_metadata
from pagemill.proto import pb
from pagemill.sampling.params import SamplingParams
from pagemill.shard.cuda_graphs import capture_decode_graphs
from pagemill.shard.errors import ShardError
from pagemill.shard.kv_pool import SCRATCH_BLOCK, KVPool
from pagemill.shard.kv_tier import open_tier
from pagemill.speculative.verify import verify

if TYPE_CHECKING:
    from pagemill.shard.engine import ModelRunner

log = logging.getLogger(__name__)


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


def run_warmup(self: "ModelRunner", req) -> "pb.WarmupResponse":
    """The Warmup RPC: the KV pool from the memory budget, the dummy steps (CPU) or decode graphs
    (CUDA), the second KV tier. RESOURCE_EXHAUSTED when the pool cannot hold one request of
    max_total_tokens; a second warmup replaces the pool and forgets every request."""
    if req.max_batch_prefill_tokens == 0 or req.max_input_tokens == 0:
        raise ShardError(
            grpc.StatusCode.INVALID_ARGUMENT, "max_batch_prefill_tokens and max_input_tokens must be > 0"
        )
    self.pool = None  # a second warmup replaces the pool
    self.requests.clear()  # their KV lived in the pool being replaced
    self.cuda_graphs = None  # graphs bake in the old pool's address
    start = time.perf_counter_ns()
    try:
        budget = cuda_budget(self, req) if self.device.type == "cuda" else self.kv_cache_memory
        allocate_pools(self, budget)
    except ValueError as e:  # the budget holds fewer than 2 blocks
        self.pool = None
        raise ShardError(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e)) from None
    if self.device.type != "cuda":
        dummy_steps(self, req)
    needed = math.ceil(req.max_total_tokens / self.block_size) + 1
    if self.pool.num_blocks < needed:
        num_blocks, self.pool = self.pool.num_blocks, None
        raise ShardError(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"KV pool holds {num_blocks} blocks of {self.block_size} tokens; one request of "
            f"max_total_tokens={req.max_total_tokens} needs {needed} (scratch block included). "
            "Give the KV cache more memory or lower max_total_tokens.",
        )
    self.cuda_graphs = capture_decode_graphs(self, req)
    elapsed = time.perf_counter_ns() - start
    log.info("warmup: %d KV blocks of %d tokens (%s), %.2fs", self.pool.num_blocks, self.block_size,
             kv_dtype_name(self.kv_dtype), elapsed / 1e9)  # fmt: skip
    resp = pb.WarmupResponse(num_blocks=self.pool.num_blocks, block_size=self.block_size, warmup_ns=elapsed)
    if self.kv_offload.enabled:
        self.store, info = open_tier(self, req)
        resp.kv_tier.CopyFrom(info)
    return resp
