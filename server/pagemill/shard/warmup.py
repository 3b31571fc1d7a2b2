"""PoolWarmup: the Warmup RPC's KV pool sizing (target and draft) and the dummy steps that
exercise the largest prefill, the widest decode and verification, before the first real step."""

from __future__ import annotations

import math
from dataclasses import dataclass

import grpc
import torch

from pagemill.attention.metadata import make_metadata
from pagemill.proto import pb
from pagemill.sampling.params import SamplingParams
from pagemill.shard.errors import ShardError
from pagemill.shard.kv_pool import SCRATCH_BLOCK, KVPool
from pagemill.speculative.verify import verify


@dataclass
class _WarmupRow:  # a SamplingRow for the dummy decode of warmup
    params: SamplingParams
    generator: None = None
    penalties: None = None
    top_n: int = 0


class PoolWarmup:
    """Sizes and allocates the KV pools of a shard's model (and draft) and runs its dummy steps."""

    def __init__(self, model, config, sampler, draft, speculate: int, block_size: int, kv_dtype: torch.dtype,
                 device: torch.device, huge_pages: bool) -> None:  # fmt: skip
        self.model, self.config, self.sampler, self.draft = model, config, sampler, draft
        self.speculate, self.block_size, self.kv_dtype = speculate, block_size, kv_dtype
        self.device, self.huge_pages = device, huge_pages

    def run(self, req, kv_cache_memory: int, gpu_memory_utilization: float, reserve: int = 0) -> KVPool:
        """The pool from the memory budget (CUDA: what the dummy steps leave free) less `reserve`
        bytes (resident LoRA adapters), after the dummy steps on CPU. RESOURCE_EXHAUSTED when the
        pool cannot hold one request of max_total_tokens."""
        if req.max_batch_prefill_tokens == 0 or req.max_input_tokens == 0:
            raise ShardError(
                grpc.StatusCode.INVALID_ARGUMENT, "max_batch_prefill_tokens and max_input_tokens must be > 0"
            )
        try:
            cuda = self.device.type == "cuda"
            budget = self.cuda_budget(req, gpu_memory_utilization) if cuda else kv_cache_memory
            pool = self.allocate(budget - reserve)
        except ValueError as e:  # the budget holds fewer than 2 blocks
            raise ShardError(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e)) from None
        if not cuda:
            self.dummy_steps(pool, req)
        needed = math.ceil(req.max_total_tokens / self.block_size) + 1
        if pool.num_blocks < needed:
            raise ShardError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"KV pool holds {pool.num_blocks} blocks of {self.block_size} tokens; one request of "
                f"max_total_tokens={req.max_total_tokens} needs {needed} (scratch block included). "
                "Give the KV cache more memory or lower max_total_tokens.",
            )
        return pool

    def allocate(self, budget: int, num_blocks: int | None = None) -> KVPool:
        """Target pool (and the draft's, with the same block count: one set of block ids
        addresses both) from a byte budget, or of exactly num_blocks."""
        if num_blocks is None:
            per_block = KVPool.bytes_per_block(self.config, self.block_size, self.kv_dtype, self.model.num_kv_heads)
            if self.draft is not None:
                per_block += KVPool.bytes_per_block(self.draft.config, self.block_size, self.draft.dtype)
            # Tensor-parallel ranks may hold different KV head counts (uneven splits) or
            # memory: the router addresses every rank's pool with one set of block ids,
            # so all take the smallest count. Before the check below, so that no rank
            # raises while the others wait in the collective.
            num_blocks = self.model.group.all_reduce_min(max(budget, 0) // per_block)
            if num_blocks < 2:
                raise ValueError(
                    f"KV cache budget of {budget} bytes holds {num_blocks} blocks of {per_block} bytes; "
                    "need at least 2 (block 0 is scratch)"
                )
        pool = KVPool.with_blocks(
            self.config, num_blocks=num_blocks, block_size=self.block_size, dtype=self.kv_dtype, device=self.device,
            num_kv_heads=self.model.num_kv_heads, huge_pages=self.huge_pages,
        )  # fmt: skip
        if self.draft is not None:
            self.draft.allocate(num_blocks)
        return pool

    def cuda_budget(self, req, gpu_memory_utilization: float) -> int:
        # Peak activation memory is measured with one-block (scratch) pools,
        # then the real pools take what is left of the utilisation budget.
        scratch = self.allocate(0, num_blocks=1)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        self.dummy_steps(scratch, req)
        torch.cuda.synchronize(self.device)
        peak_extra = torch.cuda.max_memory_allocated(self.device) - torch.cuda.memory_allocated(self.device)
        del scratch
        if self.draft is not None:
            self.draft.pool = None
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        return int(total * gpu_memory_utilization) - (total - free) - peak_extra

    @torch.inference_mode()
    def dummy_steps(self, pool: KVPool, req) -> None:
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
        hidden = self.model(ids, positions, meta, pool.kv_caches)
        if self.draft is not None:
            self.draft.forward(ids, positions, meta)
        last = torch.tensor(lens, device=self.device).cumsum(0) - 1
        self.sampler(self.model.compute_logits(hidden[last]), [_WarmupRow(SamplingParams())] * len(lens))
        self._widest_decode(pool, max(1, req.max_batch_size))

    def _widest_decode(self, pool: KVPool, b: int) -> None:
        meta = make_metadata(
            is_prefill=False, query_lens=[1] * b, kv_lens=[1] * b, block_tables=[[SCRATCH_BLOCK]] * b,
            slot_mapping=[SCRATCH_BLOCK * self.block_size] * b, device=self.device,
        )  # fmt: skip
        zeros = torch.zeros(b, dtype=torch.int64, device=self.device)
        hidden = self.model(zeros, zeros, meta, pool.kv_caches)
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
