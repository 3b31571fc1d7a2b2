"""Drives a ModelRunner directly, the way the router would, without HTTP or gRPC.

The block arithmetic is bench/block_router.py's BlockRouter; this adds timing and
a batch handle (the request ids of one prefill). Requests run with
ignore_eos so every step has the batch size asked for.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from pagemill.proto import pb
from pagemill.shard.model_runner import ModelRunner
from pagemill.bench.block_router import BlockRouter


@dataclass
class Step:
    wall_ns: int  # runner.step call, Python bookkeeping included
    forward_ns: int  # what the shard reports (model forward + sampling)
    tokens: int  # tokens computed (prefill) or generated (decode)


class ShardDriver:
    def __init__(self, runner: ModelRunner) -> None:
        if runner.pool is None:
            raise ValueError("warm the runner up first")
        self.router = BlockRouter.for_runner(runner)
        self.next_id = 0

    @property
    def lens(self) -> dict[int, int]:
        """Tokens of each unfinished request: prompt + generated."""
        return {rid: len(t.tokens) for rid, t in self.router.requests.items()}

    def prefill(self, prompts: list[list[int]], max_new_tokens: int) -> tuple[list[int], Step]:
        """One step computing every prompt; returns the batch (its request ids) and the step."""
        batch = list(range(self.next_id, self.next_id + len(prompts)))
        self.next_id += len(prompts)
        params = pb.NextTokenChooserParameters(temperature=1.0, top_p=1.0, typical_p=1.0, repetition_penalty=1.0)
        for rid, ids in zip(batch, prompts):
            self.router.add(rid, ids, max_new_tokens, params=params, ignore_eos=True)
        return batch, self._step(batch, sum(len(p) for p in prompts))

    def decode(self, batch: list[int]) -> Step:
        """One decode step of the batch's unfinished requests."""
        alive = [rid for rid in batch if rid in self.router.requests]
        return self._step(alive, len(alive))

    def _step(self, rids: list[int], tokens: int) -> Step:
        try:
            req = self.router.plan(rids)
        except IndexError:  # the free list ran dry
            raise RuntimeError("KV pool exhausted: lower batch size or lengths, or raise kv memory") from None
        start = time.perf_counter_ns()
        resp = self.router.send(req)
        return Step(time.perf_counter_ns() - start, resp.forward_ns, tokens)

    def release(self, rid: int) -> None:
        if rid in self.router.requests:
            self.router.abort(rid)


def warm_runner(runner: ModelRunner, *, max_batch_size: int, max_prefill_tokens: int, max_input: int) -> None:
    runner.warmup(
        pb.WarmupRequest(max_batch_prefill_tokens=max_prefill_tokens, max_input_tokens=max_input,
                         max_total_tokens=max_input + 1, max_batch_size=max_batch_size)
    )  # fmt: skip


def random_prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n, length), generator=g).tolist()
