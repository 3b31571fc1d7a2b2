"""Per-request state of a batch cached on the shard, and the packed inputs of a step.

Everything the router sends is checked here before any state changes, so a
bad request is answered with INVALID_ARGUMENT and the cached batches stay as
they were. Slots are fully determined by block table and position
(block_table[p // block_size] * block_size + p % block_size); the router's
slots must equal that.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Sequence

import torch

from pagemill.attention.metadata import AttentionMetadata, make_metadata
from pagemill.proto import pb
from pagemill.sampling.params import SamplingParams
from pagemill.sampling.penalties import PenaltyState
from pagemill.shard.errors import invalid


@dataclass
class RequestState:
    id: int
    token_ids: list[int]  # prompt, tokens generated before a preemption, tokens generated here
    prompt_len: int  # leading token_ids that are prompt (penalties: frequency/presence skip them)
    cache_len: int  # leading token_ids whose KV is in the pool
    max_new_tokens: int  # tokens to generate on this shard
    ignore_eos: bool
    params: SamplingParams
    generator: torch.Generator | None
    block_table: list[int]
    top_n: int
    prefill_logprobs: bool
    prefill_slots: list[int] = field(default_factory=list)  # slots of token_ids[cache_len:] at prefill
    generated: int = 0
    penalties: PenaltyState | None = None  # incremental counts, when params.has_penalties
    grammar: object | None = None  # grammar.GrammarState of a constrained request
    error: str | None = None  # set when this request alone cannot go on; it is then dropped
    draft_len: int = 0  # leading token_ids whose KV the draft model's pool holds
    min_new_tokens: int = 0  # EOS and stop_token_ids are banned until this many tokens are generated here
    stop_token_ids: frozenset[int] = frozenset()  # tokens that finish the request like EOS

    @property
    def seq_len(self) -> int:
        return len(self.token_ids)


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    meta: AttentionMetadata
    last_rows: torch.Tensor  # [B] row of each request's last token in the packed axis


def _check_table(r_id: int, table: Sequence[int], needed: int, num_blocks: int) -> None:
    if len(table) < needed:
        raise invalid(f"request {r_id}: block_table has {len(table)} blocks, needs {needed}")
    for b in table:
        if not 0 < b < num_blocks:
            raise invalid(f"request {r_id}: block id {b} out of range [1, {num_blocks}) (block 0 is scratch)")
    if len(set(table)) != len(table):
        raise invalid(f"request {r_id}: block_table repeats a block id")


def _check_slots(r_id: int, slots: Sequence[int], table: Sequence[int], start: int, block_size: int) -> None:
    for i, slot in enumerate(slots):
        pos = start + i
        expected = table[pos // block_size] * block_size + pos % block_size
        if slot != expected:
            raise invalid(
                f"request {r_id}: slot {slot} for position {pos} does not match block_table "
                f"(expected {expected} = block {table[pos // block_size]} * {block_size} + {pos % block_size})"
            )


def request_from_pb(r, *, block_size: int, num_blocks: int, vocab_size: int, device) -> RequestState:
    n = len(r.input_ids)
    if n == 0:
        raise invalid(f"request {r.id}: input_ids is empty")
    if max(r.input_ids) >= vocab_size:
        raise invalid(f"request {r.id}: token id {max(r.input_ids)} >= vocab_size {vocab_size}")
    if r.cache_len >= n:
        raise invalid(f"request {r.id}: cache_len {r.cache_len} must be < len(input_ids) {n} (one token to compute)")
    if r.generated_len >= n:
        raise invalid(f"request {r.id}: generated_len {r.generated_len} must be < len(input_ids) {n}")
    if r.stopping_parameters.max_new_tokens < 1:
        raise invalid(f"request {r.id}: max_new_tokens must be >= 1")
    if r.top_n_tokens > vocab_size:
        raise invalid(f"request {r.id}: top_n_tokens {r.top_n_tokens} > vocab_size {vocab_size}")
    stopping = r.stopping_parameters
    for name, ids in (("stop_token_ids", stopping.stop_token_ids), ("logit_bias", r.parameters.logit_bias.keys())):
        if any(t >= vocab_size for t in ids):
            raise invalid(f"request {r.id}: {name} has a token id >= vocab_size {vocab_size}")
    table = list(r.block_table)
    _check_table(r.id, table, -(-n // block_size), num_blocks)
    if len(r.slots) != n - r.cache_len:
        raise invalid(f"request {r.id}: {len(r.slots)} slots for {n - r.cache_len} uncached tokens")
    _check_slots(r.id, r.slots, table, r.cache_len, block_size)
    try:
        params = SamplingParams.from_pb(r.parameters) if r.HasField("parameters") else SamplingParams()
    except ValueError as e:
        raise invalid(f"request {r.id}: {e}") from None
    generator = None
    if params.seed is not None and not params.greedy:
        generator = torch.Generator(device=device)
        generator.manual_seed(params.seed)
    penalties = None
    if params.has_penalties:
        penalties = PenaltyState.from_tokens(r.input_ids, n - r.generated_len, vocab_size, device)
    return RequestState(
        id=r.id,
        token_ids=list(r.input_ids),
        prompt_len=n - r.generated_len,
        cache_len=r.cache_len,
        max_new_tokens=r.stopping_parameters.max_new_tokens,
        ignore_eos=r.stopping_parameters.ignore_eos_token,
        params=params,
        generator=generator,
        block_table=table,
        top_n=r.top_n_tokens,
        prefill_logprobs=r.prefill_logprobs,
        prefill_slots=list(r.slots),
        penalties=penalties,
        min_new_tokens=stopping.min_new_tokens,
        stop_token_ids=frozenset(stopping.stop_token_ids),
    )


@dataclass
class ShardBatch:
    id: int
    requests: list[RequestState]

    @classmethod
    def from_pb(cls, batch, *, block_size: int, num_blocks: int, vocab_size: int, device) -> "ShardBatch":
        if not batch.requests:
            raise invalid(f"batch {batch.id} has no requests")
        reqs = [
            request_from_pb(r, block_size=block_size, num_blocks=num_blocks, vocab_size=vocab_size, device=device)
            for r in batch.requests
        ]
        _check_unique(r.id for r in reqs)
        return cls(batch.id, reqs)

    @classmethod
    def concatenate(cls, batches: Sequence["ShardBatch"]) -> "ShardBatch":
        """A new batch with the first one's id; the inputs are left as they are."""
        reqs = [r for b in batches for r in b.requests]
        _check_unique(r.id for r in reqs)
        return cls(batches[0].id, reqs)

    def filter(self, request_ids: Iterable[int]) -> "ShardBatch":
        keep = set(request_ids)
        unknown = keep - {r.id for r in self.requests}
        if unknown:
            raise invalid(f"batch {self.id} has no request(s) {sorted(unknown)}")
        return ShardBatch(self.id, [r for r in self.requests if r.id in keep])

    def to_pb(self):
        return pb.CachedBatch(id=self.id, request_ids=[r.id for r in self.requests])

    def prefill_inputs(self, device) -> StepInputs:
        """Only token_ids[cache_len:] are computed; their positions start at cache_len."""
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        last_rows: list[int] = []
        for r in self.requests:
            ids += r.token_ids[r.cache_len :]
            positions += range(r.cache_len, r.seq_len)
            slots += r.prefill_slots
            last_rows.append(len(ids) - 1)
        meta = make_metadata(
            is_prefill=True,
            query_lens=[r.seq_len - r.cache_len for r in self.requests],
            kv_lens=[r.seq_len for r in self.requests],
            block_tables=[r.block_table for r in self.requests],
            slot_mapping=slots,
            device=device,
        )
        return _inputs(ids, positions, meta, last_rows, device)

    def assign_decode_slots(
        self, slots: Sequence, *, block_size: int, num_blocks: int, speculate: int = 0
    ) -> list[list[int]]:
        """Checks the router's pb.RequestSlots and adopts their block tables.

        Returns each request's speculate + 1 slots (positions seq_len - 1 ..
        seq_len - 1 + speculate), in batch order. Raises before changing
        anything when one entry is wrong.
        """
        by_id = {}
        for s in slots:
            if s.request_id in by_id:
                raise invalid(f"request {s.request_id} has two RequestSlots entries")
            by_id[s.request_id] = s
        ours = {r.id for r in self.requests}
        if set(by_id) != ours:
            missing, extra = sorted(ours - set(by_id)), sorted(set(by_id) - ours)
            raise invalid(f"RequestSlots do not match the batch: missing {missing}, unknown {extra}")
        for r in self.requests:
            s = by_id[r.id]
            table, pos = list(s.block_table), r.seq_len - 1  # position of the token fed this step
            _check_table(r.id, table, (pos + speculate) // block_size + 1, num_blocks)
            computed = -(-pos // block_size)  # blocks holding KV written earlier must stay put
            if table[:computed] != r.block_table[:computed]:
                raise invalid(f"request {r.id}: block_table changed blocks that already hold its KV")
            if len(s.slots) != speculate + 1:
                raise invalid(
                    f"request {r.id}: decode takes speculate + 1 = {speculate + 1} slots per request, "
                    f"got {len(s.slots)}"
                )
            _check_slots(r.id, s.slots, table, pos, block_size)
        for r in self.requests:
            r.block_table = list(by_id[r.id].block_table)
        return [list(by_id[r.id].slots) for r in self.requests]

    def decode_inputs(self, slots: Sequence[int], device) -> StepInputs:
        """One token per request: the last one, at position seq_len - 1."""
        meta = make_metadata(
            is_prefill=False,
            query_lens=[1] * len(self.requests),
            kv_lens=[r.seq_len for r in self.requests],
            block_tables=[r.block_table for r in self.requests],
            slot_mapping=slots,
            device=device,
        )
        ids = [r.token_ids[-1] for r in self.requests]
        positions = [r.seq_len - 1 for r in self.requests]
        return _inputs(ids, positions, meta, list(range(len(ids))), device)


    def verify_inputs(self, proposals: Sequence[Sequence[int]], slots: Sequence[Sequence[int]], device) -> StepInputs:
        """Last token plus its proposals per request, as one varlen prefill over the
        cached context (query_len = 1 + proposals); every row's logits are needed."""
        ids: list[int] = []
        positions: list[int] = []
        flat_slots: list[int] = []
        for r, props, s in zip(self.requests, proposals, slots):
            fed = [r.token_ids[-1], *props]
            ids += fed
            positions += range(r.seq_len - 1, r.seq_len - 1 + len(fed))
            flat_slots += s[: len(fed)]
        meta = make_metadata(
            is_prefill=True,
            query_lens=[1 + len(p) for p in proposals],
            kv_lens=[r.seq_len + len(p) for r, p in zip(self.requests, proposals)],
            block_tables=[r.block_table for r in self.requests],
            slot_mapping=flat_slots,
            device=device,
        )
        return _inputs(ids, positions, meta, list(range(len(ids))), device)


def _inputs(ids, positions, meta, last_rows, device) -> StepInputs:
    def t(x):
        return torch.tensor(x, dtype=torch.int64, device=device)

    return StepInputs(t(ids), t(positions), meta, t(last_rows))


def _check_unique(ids: Iterable[int]) -> None:
    seen: set[int] = set()
    for i in ids:
        if i in seen:
            raise invalid(f"request id {i} appears twice in the batch")
        seen.add(i)
