"""CUDA graphs for plain decode steps, at bucketed batch sizes (nano-vllm's scheme).

A decode step of a small model is a few hundred tiny kernel launches; on a
GPU their launch overhead, not HBM, bounds the step. A graph replays the
whole forward (embedding .. lm_head) with one launch. Graphs need fixed
shapes and fixed addresses, so:

- one set of static input buffers sized for the largest bucket (input_ids,
  positions, slot_mapping, block_tables padded to the widest table
  max_total_tokens can need, context_lens) and one logits buffer; the graph
  of bucket n reads and writes their first n rows;
- a step of batch b copies its inputs into the first b rows, turns rows
  b..n of the smallest bucket n >= b into padding (token 0 at position 0,
  written to the scratch slot of block 0 and attending to that one key:
  harmless, finite, never read back), replays, and hands logits[:b] to the
  (eager) sampler;
- the attention metadata is static (AttentionMetadata.static): its host
  fields are fixed per bucket (kv_lens / max_seqlen_k = the table width in
  tokens), so the Triton decode grid and its split-K count are fixed per
  bucket, and backends mask by context_lens on the device (no host syncs).

`forward` is the function that is captured. It runs eagerly too (CPU,
tests), so the padding and bucketing are tested without CUDA. Prefill,
speculative decoding and batches wider than the largest bucket stay eager.
"""

from __future__ import annotations

import bisect
import logging
import math
import time

import torch

from pagemill.attention.metadata import AttentionMetadata
from pagemill.shard.kv_pool import SCRATCH_BLOCK

log = logging.getLogger(__name__)

# Batches above this run eagerly: launch overhead is amortised over so many
# rows by then, and each bucket costs capture time (vLLM caps at 512).
MAX_GRAPH_BATCH = 256


def graph_batch_sizes(max_batch_size: int, cap: int = MAX_GRAPH_BATCH) -> list[int]:
    """1, 2, 4, 8, then every 8 up to min(max_batch_size, cap), which is always a bucket.

    Steps of 8 keep padding under 8 rows (under 1/3 of the batch from 16 on).
    """
    top = max(1, min(max_batch_size, cap))
    sizes = [s for s in (1, 2, 4, 8) if s < top] + list(range(16, top, 8))
    return sizes + [top]


def select_bucket(sizes: list[int], batch: int) -> int | None:
    """The smallest bucket that holds `batch` rows, or None if none does."""
    i = bisect.bisect_left(sizes, batch)
    return sizes[i] if i < len(sizes) else None


class DecodeGraphs:
    def __init__(
        self,
        model,
        kv_caches,
        *,
        max_batch_size: int,
        max_total_tokens: int,
        block_size: int,
        vocab_size: int,
        device: torch.device | str,
        buckets: list[int] | None = None,  # default graph_batch_sizes(max_batch_size); the sweep times one
    ) -> None:
        self.model, self.kv_caches = model, kv_caches
        self.sizes = sorted(buckets) if buckets else graph_batch_sizes(max_batch_size)
        self.max_blocks = math.ceil(max_total_tokens / block_size)
        self.scratch_slot = SCRATCH_BLOCK * block_size
        n, device = self.sizes[-1], torch.device(device)
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((n,), self.scratch_slot, dtype=torch.int64, device=device)
        self.block_tables = torch.full((n, self.max_blocks), SCRATCH_BLOCK, dtype=torch.int32, device=device)
        self.context_lens = torch.ones(n, dtype=torch.int32, device=device)
        self.logits = torch.zeros(n, vocab_size, dtype=torch.float32, device=device)
        max_len = self.max_blocks * block_size
        self.metas = {b: self._meta(b, max_len, device) for b in self.sizes}
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}

    def _meta(self, b: int, max_len: int, device: torch.device) -> AttentionMetadata:
        rows = torch.arange(b + 1, dtype=torch.int32, device=device)
        return AttentionMetadata(
            is_prefill=False, slot_mapping=self.slot_mapping[:b], cu_seqlens_q=rows, cu_seqlens_k=rows * max_len,
            max_seqlen_q=1, max_seqlen_k=max_len, block_tables=self.block_tables[:b],
            context_lens=self.context_lens[:b], query_lens=[1] * b, kv_lens=[max_len] * b, static=True,
        )  # fmt: skip

    def forward(self, bucket: int) -> None:
        """The captured function: model forward + lm_head of the first `bucket` buffer rows."""
        meta = self.metas[bucket]
        meta.derived.clear()  # eager reruns must not reuse tensors derived from the last step's tables
        hidden = self.model(self.input_ids[:bucket], self.positions[:bucket], meta, self.kv_caches)
        self.logits[:bucket] = self.model.compute_logits(hidden)

    def load(self, inputs) -> int | None:
        """Copies a decode step into the buffers; returns its bucket, or None if it does not fit."""
        meta = inputs.meta
        b, width = meta.num_seqs, meta.block_tables.shape[1]
        bucket = select_bucket(self.sizes, b)
        if bucket is None or width > self.max_blocks:
            return None
        self.input_ids[:b].copy_(inputs.input_ids)
        self.positions[:b].copy_(inputs.positions)
        self.slot_mapping[:b].copy_(meta.slot_mapping)
        self.block_tables[:b, :width].copy_(meta.block_tables)
        self.block_tables[:b, width:].fill_(SCRATCH_BLOCK)  # stale entries of a wider earlier step
        self.context_lens[:b].copy_(meta.context_lens)
        # Rows b..bucket may hold an earlier, larger step's sequences: point them at scratch so the
        # replay cannot write into blocks the router has handed to someone else.
        self.input_ids[b:bucket].zero_()
        self.positions[b:bucket].zero_()
        self.slot_mapping[b:bucket].fill_(self.scratch_slot)
        self.block_tables[b:bucket].fill_(SCRATCH_BLOCK)
        self.context_lens[b:bucket].fill_(1)
        return bucket

    def logits_for(self, inputs) -> torch.Tensor | None:
        """Float32 logits [b, vocab] of a plain decode step, or None (the caller runs it eagerly).

        A view of the shared buffer: valid until the next step.
        """
        bucket = self.load(inputs)
        if bucket is None:
            return None
        graph = self.graphs.get(bucket)
        if graph is not None:
            graph.replay()
        else:  # not captured (CPU, tests): the same computation, eagerly
            self.forward(bucket)
        return self.logits[: inputs.meta.num_seqs]

    @torch.inference_mode()
    def capture(self) -> None:
        """Captures every bucket, largest first so the smaller graphs reuse its memory pool.

        A bucket whose capture runs out of memory is dropped (its batches take the next larger
        captured bucket, or run eagerly). Needs the KV pool allocated: graphs bake in its address.
        """
        start, before = time.perf_counter(), torch.cuda.memory_reserved()
        pool = None
        for bucket in reversed(self.sizes):
            graph = torch.cuda.CUDAGraph()
            try:
                self.forward(bucket)  # compiles the Triton kernels of this grid outside the capture
                torch.cuda.synchronize()
                with torch.cuda.graph(graph, pool=pool):
                    self.forward(bucket)
            except torch.cuda.OutOfMemoryError:
                log.warning("cuda graphs: out of memory capturing decode batch %d; it runs on a larger "
                            "bucket or eagerly", bucket)  # fmt: skip
                torch.cuda.empty_cache()
                continue
            pool = pool or graph.pool()
            self.graphs[bucket] = graph
        torch.cuda.synchronize()
        self.sizes = sorted(self.graphs)
        log.info(
            "cuda graphs: captured %d decode batch sizes (%s), tables of %d blocks, %.1fs, %.0f MiB",
            len(self.sizes), ",".join(map(str, self.sizes)), self.max_blocks, time.perf_counter() - start,
            (torch.cuda.memory_reserved() - before) / 2**20,
        )  # fmt: skip


def capture_decode_graphs(runner, req) -> DecodeGraphs | None:
    """The runner's decode graphs after warmup (KV pool allocated), or None when they do not apply."""
    if not runner.use_cuda_graphs:
        return None
    graphs = DecodeGraphs(
        runner.model, runner.pool.kv_caches, max_batch_size=max(1, req.max_batch_size),
        max_total_tokens=req.max_total_tokens, block_size=runner.block_size, vocab_size=runner.config.vocab_size,
        device=runner.device,
    )  # fmt: skip
    try:
        graphs.capture()
    except Exception:  # serve eagerly rather than not at all; tests/test_cuda_graphs.py fails loudly instead
        log.exception("cuda graphs: capture failed; decode runs eagerly (--no-cuda-graphs silences this)")
        torch.cuda.synchronize()
        return None
    return graphs if graphs.graphs else None
