"""BlockRouter: the router's side of the Step protocol, for tests and shard benchmarks.

It is the one place outside the Rust router that does block arithmetic
(`Blocks`, which model-level tests use too): a shuffled free list of block
ids 1..num_blocks-1 (block 0 is scratch), a table per request grown by one
block whenever a sequence crosses a block boundary (plus room for
`speculate` proposals on decode entries), reference counts so that forks and
prefix reuse share blocks. It builds
pb.StepRequests, hands them to a step function (ModelRunner.step, or a gRPC
stub's Step) and folds the answers back: tokens, computed counts, finishes.

A rejected call (the step function raises) leaves the router as it was, so a
test can send garbage and then carry on.
"""

from __future__ import annotations

import math

import random
from dataclasses import dataclass, field
from typing import Callable, Iterable

from pagemill.proto import pb
from pagemill.shard.step_inputs import slot


class Blocks:
    """Block ids 1..num_blocks-1, handed out in shuffled order (non-contiguous, out-of-order
    tables), reference-counted so that tables may share blocks."""

    def __init__(self, num_blocks: int, block_size: int, seed: int = 0) -> None:
        self.block_size = block_size
        self.free = list(range(1, num_blocks))
        random.Random(seed).shuffle(self.free)
        self.refs: dict[int, int] = {}

    def grow(self, table: list[int], positions: int) -> list[int]:
        """A new block only when the sequence crosses a block boundary."""
        while len(table) * self.block_size < positions:
            b = self.free.pop()
            self.refs[b] = 1
            table.append(b)
        return table

    def share(self, table: list[int]) -> list[int]:
        for b in table:
            self.refs[b] += 1
        return list(table)

    def release(self, table: list[int]) -> None:
        for b in table:
            self.refs[b] -= 1
            if self.refs[b] == 0:
                del self.refs[b]
                self.free.append(b)
        table.clear()

    def slots(self, table: list[int], start: int, end: int) -> list[int]:
        """Slots of positions start..end-1, growing the table to hold them."""
        self.grow(table, end)
        return [slot(table, p, self.block_size) for p in range(start, end)]


@dataclass
class Output:
    """Everything the shard returned for one request."""

    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top: list[list[int]] = field(default_factory=list)
    finish: int = pb.FINISH_REASON_UNSPECIFIED
    error: str = ""
    # With prefill_logprobs: the logprob of each prompt position, NaN where none came
    # (the first token, a cached prefix); rank and alternatives where reported.
    prompt: list[float] = field(default_factory=list)
    prompt_ranks: dict[int, int] = field(default_factory=dict)
    prompt_top: dict[int, list[int]] = field(default_factory=dict)
    done: bool = False


@dataclass
class Tracked:
    new: pb.NewRequest  # as first sent; resent with the generated tokens after a preemption
    tokens: list[int]  # what the shard knows: prompt, then every token it returned
    chunk: int | None  # most prompt tokens per step (None: the whole rest)
    computed: int = 0
    table: list[int] = field(default_factory=list)
    sent_blocks: int = 0  # leading table entries the shard holds
    fresh: bool = True  # the next entry carries new_request
    out: Output = field(default_factory=Output)


def step_response(result) -> pb.StepResponse:
    """ModelRunner.step's StepResult as the service would answer it."""
    return pb.StepResponse(generations=result.generations, forward_ns=result.forward_ns, total_ns=result.forward_ns)


def fold_prompt_logprobs(o: Output, p) -> None:
    """One step's pb.PromptLogprobs into the request's per-position lists."""
    for i, lp in enumerate(p.logprobs):
        o.prompt[p.first + i] = lp
        o.prompt_ranks[p.first + i] = p.ranks[i]
        if p.top:
            o.prompt_top[p.first + i] = list(p.top[i].ids)


class BlockRouter:
    def __init__(self, step: Callable, num_blocks: int, block_size: int, *, speculate: int = 0, seed: int = 0):
        self._step = step  # pb.StepRequest -> pb.StepResponse
        self.block_size, self.speculate = block_size, speculate
        self.blocks = Blocks(num_blocks, block_size, seed)
        self.requests: dict[int, Tracked] = {}  # unfinished ones
        self.outputs: dict[int, Output] = {}
        self.finished_ids: list[int] = []  # ended here since the last step

    @classmethod
    def for_runner(cls, runner, **kw) -> "BlockRouter":
        return cls(lambda r: step_response(runner.step(r)), runner.pool.num_blocks, runner.block_size,
                   speculate=runner.speculate, **kw)  # fmt: skip

    # --- requests -------------------------------------------------------------------

    def add(self, rid: int, prompt: Iterable[int], max_new_tokens: int, *, params=None, ignore_eos: bool = False,
            min_new_tokens: int = 0, stop_token_ids=(), top_n: int = 0, prefill_logprobs: bool = False,
            grammar=None, prefix: tuple[int, int] | None = None, chunk: int | None = None,
            prompt_top_n: int = 0, adapter: pb.Adapter | None = None) -> Output:
        """Queues a request; it joins the next step. prefix=(rid, n): its first n tokens (whole
        blocks) are those of a request still held here, whose blocks it shares (a fork, or a
        prefix-cache hit); they count as computed even if that request computes them in the
        same step. adapter: the LoRA adapter it runs with (resent after a preemption)."""
        prompt = list(prompt)
        stopping = pb.StoppingCriteriaParameters(max_new_tokens=max_new_tokens, ignore_eos_token=ignore_eos,
                                                 min_new_tokens=min_new_tokens, stop_token_ids=list(stop_token_ids))
        new = pb.NewRequest(input_ids=prompt, parameters=params or pb.NextTokenChooserParameters(),
                            stopping_parameters=stopping, top_n_tokens=top_n, prefill_logprobs=prefill_logprobs,
                            grammar=grammar, prompt_top_n=prompt_top_n, adapter=adapter)  # fmt: skip
        t = Tracked(new, list(prompt), chunk)
        if prefill_logprobs:
            t.out.prompt = [math.nan] * len(prompt)
        if prefix is not None:
            src, n = self.requests[prefix[0]], prefix[1]
            assert n % self.block_size == 0 and src.tokens[:n] == t.tokens[:n], "a shared prefix is whole blocks"
            self.blocks.grow(src.table, n)
            t.table, t.computed = self.blocks.share(src.table[: n // self.block_size]), n
        self.requests[rid] = t
        self.outputs[rid] = t.out
        return t.out

    def abort(self, rid: int) -> None:
        """The router ends a request (client gone, stop sequence): the shard hears it next step."""
        self.blocks.release(self.requests.pop(rid).table)
        self.outputs[rid].done = True
        self.finished_ids.append(rid)

    def preempt(self, rid: int) -> None:
        """Frees the request's blocks; it is recomputed later from its prompt and generated tokens."""
        t = self.requests[rid]
        self.blocks.release(t.table)
        generated = len(t.tokens) - len(t.new.input_ids) + t.new.generated_len
        fresh = pb.NewRequest()
        fresh.CopyFrom(t.new)
        del fresh.input_ids[:]
        fresh.input_ids.extend(t.tokens)
        fresh.generated_len = generated
        # What is left of the request's budgets (the router sends remainders after a preemption).
        done_here = len(t.tokens) - len(t.new.input_ids)
        fresh.stopping_parameters.max_new_tokens = t.new.stopping_parameters.max_new_tokens - done_here
        fresh.stopping_parameters.min_new_tokens = max(0, t.new.stopping_parameters.min_new_tokens - done_here)
        t.new, t.computed, t.table, t.sent_blocks, t.fresh = fresh, 0, [], 0, True
        self.finished_ids.append(rid)

    # --- steps ----------------------------------------------------------------------

    def plan(self, rids: Iterable[int] | None = None) -> pb.StepRequest:
        """The next step for `rids` (default: every unfinished request, in the order added)."""
        entries = []
        for rid in self.requests if rids is None else rids:
            t = self.requests[rid]
            left = len(t.tokens) - t.computed
            n = left if t.chunk is None or left <= 1 else min(left, t.chunk)
            proposals = self.speculate if n == left == 1 else 0
            self.blocks.grow(t.table, t.computed + n + proposals)
            entries.append(pb.ScheduledRequest(
                id=rid, new_request=t.new if t.fresh else None, num_computed=t.computed, num_tokens=n,
                new_block_ids=t.table[0 if t.fresh else t.sent_blocks :], max_proposals=proposals,
            ))  # fmt: skip
        return pb.StepRequest(requests=entries, finished_ids=self.finished_ids)

    def send(self, req: pb.StepRequest) -> pb.StepResponse:
        """Calls the shard with `req` and folds its answer in (entries for ids not held here are skipped)."""
        resp = self._step(req)
        assert [g.request_id for g in resp.generations] == [e.id for e in req.requests], "one Generation per entry"
        sent = set(req.finished_ids)
        self.finished_ids = [i for i in self.finished_ids if i not in sent]
        for e, g in zip(req.requests, resp.generations):
            t = self.requests.get(e.id)
            if t is None:
                continue
            t.sent_blocks = (0 if e.HasField("new_request") else t.sent_blocks) + len(e.new_block_ids)
            t.fresh = False
            m = len(g.tokens.ids)
            t.computed = e.num_computed + e.num_tokens + max(m - 1, 0)
            t.tokens += g.tokens.ids
            o = t.out
            o.ids += g.tokens.ids
            o.logprobs += g.tokens.logprobs
            o.top += [list(x.ids) for x in g.top_tokens]
            if g.HasField("prompt_logprobs"):
                fold_prompt_logprobs(o, g.prompt_logprobs)
            o.finish, o.error = g.finish_reason, g.error
            if g.error or g.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
                o.done = True
                self.blocks.release(self.requests.pop(e.id).table)  # the shard dropped it itself
        return resp

    def step(self, rids: Iterable[int] | None = None) -> pb.StepResponse:
        return self.send(self.plan(rids))

    def run(self, max_steps: int = 100_000) -> dict[int, Output]:
        """Steps every unfinished request until none is left; returns every request's output."""
        for _ in range(max_steps):
            if not self.requests:
                return self.outputs
            self.step()
        raise AssertionError(f"requests {sorted(self.requests)} unfinished after {max_steps} steps")

    def generate(self, prompts, max_new_tokens: int, *, params=None, grammars=None, **kw) -> dict[int, Output]:
        """Requests 0..len(prompts)-1 (per-request params/grammars lists), run to the end together."""
        for rid, prompt in enumerate(prompts):
            self.add(rid, prompt, max_new_tokens, params=params[rid] if params else None,
                     grammar=grammars[rid] if grammars else None, **kw)  # fmt: skip
        return self.run()
