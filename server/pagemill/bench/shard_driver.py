"""Drives a ModelRunner directly, the way the router would, without HTTP or gRPC.

The driver plays the router's part: it hands out block ids from a free list,
computes slots (block * block_size + offset) and grows a sequence's table by
one block when it crosses a block boundary. Requests run with ignore_eos so
every step has the batch size asked for.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from pagemill.proto import pb
from pagemill.shard.batch import ShardBatch
from pagemill.shard.engine import ModelRunner, StepResult


@dataclass
class Step:
    wall_ns: int  # runner.prefill/decode call, Python bookkeeping included
    forward_ns: int  # what the shard reports (model forward + sampling)
    tokens: int  # tokens computed (prefill) or generated (decode)


class ShardDriver:
    def __init__(self, runner: ModelRunner) -> None:
        if runner.pool is None:
            raise ValueError("warm the runner up first")
        self.runner = runner
        self.bs = runner.block_size
        self.free = list(range(runner.pool.num_blocks - 1, 0, -1))  # block 0 is scratch
        self.tables: dict[int, list[int]] = {}
        self.lens: dict[int, int] = {}  # tokens of each request: prompt + generated
        self.next_id = 0

    def _slots(self, rid: int, start: int, end: int) -> list[int]:
        table = self.tables.setdefault(rid, [])
        while len(table) * self.bs < end:
            if not self.free:
                raise RuntimeError("KV pool exhausted: lower batch size or lengths, or raise kv memory")
            table.append(self.free.pop())
        return [table[p // self.bs] * self.bs + p % self.bs for p in range(start, end)]

    def prefill(self, prompts: list[list[int]], max_new_tokens: int) -> tuple[ShardBatch, Step]:
        requests = []
        for ids in prompts:
            rid, self.next_id = self.next_id, self.next_id + 1
            slots = self._slots(rid, 0, len(ids))
            self.lens[rid] = len(ids)
            requests.append(
                pb.Request(
                    id=rid, input_ids=ids, block_table=self.tables[rid], slots=slots,
                    parameters=pb.NextTokenChooserParameters(temperature=1.0, top_p=1.0, typical_p=1.0,
                                                             repetition_penalty=1.0),
                    stopping_parameters=pb.StoppingCriteriaParameters(max_new_tokens=max_new_tokens,
                                                                      ignore_eos_token=True),
                )
            )  # fmt: skip
        batch = self.runner.new_batch(pb.Batch(id=self.next_id, requests=requests))
        start = time.perf_counter_ns()
        result = self.runner.prefill(batch)
        step = Step(time.perf_counter_ns() - start, result.forward_ns, sum(len(p) for p in prompts))
        self._account(result)
        return batch, step

    def decode(self, batch: ShardBatch) -> Step:
        slots = []
        for r in batch.requests:
            rid, pos = r.id, self.lens[r.id] - 1  # the newest token, fed this step
            slots.append(pb.RequestSlots(request_id=rid, slots=self._slots(rid, pos, pos + 1),
                                         block_table=self.tables[rid]))  # fmt: skip
        start = time.perf_counter_ns()
        result = self.runner.decode(batch, slots)
        step = Step(time.perf_counter_ns() - start, result.forward_ns, len(result.generations))
        self._account(result)
        return step

    def _account(self, result: StepResult) -> None:
        for g in result.generations:
            self.lens[g.request_id] += 1
            if g.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
                self.release(g.request_id)

    def release(self, rid: int) -> None:
        self.free.extend(self.tables.pop(rid, []))
        self.lens.pop(rid, None)


def warm_runner(runner: ModelRunner, *, max_batch_size: int, max_prefill_tokens: int, max_input: int) -> None:
    runner.warmup(
        pb.WarmupRequest(max_batch_prefill_tokens=max_prefill_tokens, max_input_tokens=max_input,
                         max_total_tokens=max_input + 1, max_batch_size=max_batch_size)
    )  # fmt: skip


def random_prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n, length), generator=g).tolist()
