"""Per-request state the shard keeps between steps, and checking a StepRequest against it.

Checks come in two kinds. Protocol garbage (duplicate ids in one step, a
malformed NewRequest, a block id out of range, a table too short for the
scheduled positions) rejects the whole call with INVALID_ARGUMENT before any
state changes. An entry that merely contradicts what the shard holds (an
unknown id without new_request, a num_computed other than the shard's)
fails that request alone: it is not computed and its state is dropped, the
rest of the step runs. `check_step` is pure; `apply_step` then commits.
"""

from __future__ import annotations

from dataclasses import dataclass, field
import torch

from pagemill.sampling.params import SamplingParams
from pagemill.sampling.penalties import PenaltyState
from pagemill.shard.errors import invalid


@dataclass
class RequestState:
    id: int
    token_ids: list[int]  # prompt, tokens generated before a preemption, tokens sampled here
    prompt_len: int  # leading token_ids that are prompt (penalties: frequency/presence skip them)
    computed: int  # leading token_ids whose KV is in the pool
    max_new_tokens: int  # tokens to generate on this shard
    ignore_eos: bool
    params: SamplingParams
    generator: torch.Generator | None
    block_table: list[int]
    top_n: int
    prefill_logprobs: bool
    generated: int = 0  # tokens sampled on this shard since the NewRequest
    penalties: PenaltyState | None = None  # incremental counts, when params.has_penalties
    grammar: object | None = None  # grammar.GrammarState of a constrained request
    error: str | None = None  # set when this request alone cannot go on; it is then dropped
    draft_len: int = 0  # leading token_ids whose KV the draft model's pool holds
    min_new_tokens: int = 0  # EOS and stop_token_ids are banned until this many tokens are generated here
    stop_token_ids: frozenset[int] = frozenset()  # tokens that finish the request like EOS
    prompt_top_n: int = 0  # alternatives reported at each prompt position (with prefill_logprobs)
    adapter: object | None = None  # lora.apply.LoadedAdapter the request runs with (None: the base model)

    @property
    def seq_len(self) -> int:
        return len(self.token_ids)


@dataclass
class Limits:
    block_size: int
    num_blocks: int
    vocab_size: int
    device: torch.device
    # Every layer's window (0: some layer is global; InfoResponse.sliding_window): the router
    # gives back blocks behind it, and may hand the same id to this request again later.
    sliding_window: int = 0


@dataclass
class Entry:
    """One ScheduledRequest after checking."""

    id: int
    state: RequestState | None  # None: the entry contradicts the shard (error says how); not computed
    start: int  # num_computed
    num_tokens: int
    max_proposals: int
    new_blocks: list[int]
    fresh: bool  # carried a NewRequest: its state replaces whatever the shard held
    error: str | None = None
    proposals: list[int] = field(default_factory=list)  # filled by the runner on decode entries

    @property
    def end(self) -> int:
        return self.start + self.num_tokens

    @property
    def sampled(self) -> bool:
        """The range reaches the end of the known tokens: the shard samples the next one."""
        return self.state is not None and self.end == self.state.seq_len

    @property
    def is_decode(self) -> bool:
        return self.sampled and self.num_tokens == 1


def check_step(req, held: dict[int, RequestState], lim: Limits) -> list[Entry]:
    """Entries in request order; raises ShardError (INVALID_ARGUMENT) on protocol garbage.

    Changes nothing: fresh entries get a new RequestState that apply_step installs."""
    finished = set(req.finished_ids)
    seen: set[int] = set()
    entries = []
    for s in req.requests:
        if s.id in seen:
            raise invalid(f"request {s.id} is scheduled twice in one step")
        seen.add(s.id)
        if s.num_tokens < 1:
            raise invalid(f"request {s.id}: num_tokens must be >= 1")
        for b in s.new_block_ids:
            if not 0 < b < lim.num_blocks:
                raise invalid(f"request {s.id}: block id {b} out of range [1, {lim.num_blocks}) (block 0 is scratch)")
        fresh = s.HasField("new_request")
        if fresh:
            state = new_state(s.id, s.new_request, s.num_computed, lim)
            table = list(s.new_block_ids)
        else:
            # finished_ids are dropped before the entries are looked at.
            state = held.get(s.id) if s.id not in finished else None
            if state is None:
                entries.append(_failed(s, f"request {s.id} is unknown to the shard and has no new_request"))
                continue
            if s.num_computed != state.computed:
                entries.append(_failed(
                    s, f"request {s.id}: num_computed {s.num_computed} but the shard computed {state.computed}"
                ))  # fmt: skip
                continue
            table = state.block_table + list(s.new_block_ids) if s.new_block_ids else state.block_table
        end = s.num_computed + s.num_tokens
        if end > state.seq_len:
            raise invalid(f"request {s.id}: range {s.num_computed}..{end} is past its {state.seq_len} known tokens")
        needed = -(-(end + s.max_proposals) // lim.block_size)
        if len(table) < needed:
            raise invalid(f"request {s.id}: block table has {len(table)} blocks, positions up to "
                          f"{end + s.max_proposals} need {needed}")  # fmt: skip
        # Blocks wholly behind every layer's window were given back (docs/kv_cache.md): only
        # the ones still read must be distinct. A held table without new blocks passed this on
        # an earlier step with no more blocks dead (num_computed only grows): its live part
        # now is a suffix of what was distinct then, so only new blocks need the check.
        if fresh or s.new_block_ids:
            dead = max(0, s.num_computed + 1 - lim.sliding_window) // lim.block_size if lim.sliding_window else 0
            live = table[dead:]
            if len(set(live)) != len(live):
                raise invalid(f"request {s.id}: block table repeats a block id")
        entries.append(Entry(s.id, state, s.num_computed, s.num_tokens, s.max_proposals, list(s.new_block_ids), fresh))
    return entries


def apply_step(req, entries: list[Entry], held: dict[int, RequestState]) -> None:
    """Drops finished and contradicting requests, installs fresh ones, extends block tables."""
    for rid in req.finished_ids:
        held.pop(rid, None)
    for e in entries:
        if e.state is None:
            held.pop(e.id, None)
        elif e.fresh:
            e.state.block_table = list(e.new_blocks)
            held[e.id] = e.state
        else:
            e.state.block_table += e.new_blocks


def _failed(s, error: str) -> Entry:
    return Entry(s.id, None, s.num_computed, s.num_tokens, s.max_proposals, [], False, error)


def new_state(rid: int, r, num_computed: int, lim: Limits) -> RequestState:
    n = len(r.input_ids)
    if n == 0:
        raise invalid(f"request {rid}: input_ids is empty")
    if max(r.input_ids) >= lim.vocab_size:
        raise invalid(f"request {rid}: token id {max(r.input_ids)} >= vocab_size {lim.vocab_size}")
    if num_computed >= n:
        raise invalid(f"request {rid}: num_computed {num_computed} must be < len(input_ids) {n}")
    if r.generated_len >= n:
        raise invalid(f"request {rid}: generated_len {r.generated_len} must be < len(input_ids) {n}")
    stopping = r.stopping_parameters
    if stopping.max_new_tokens < 1:
        raise invalid(f"request {rid}: max_new_tokens must be >= 1")
    for name, n_ in (("top_n_tokens", r.top_n_tokens), ("prompt_top_n", r.prompt_top_n)):
        if n_ > lim.vocab_size:
            raise invalid(f"request {rid}: {name} {n_} > vocab_size {lim.vocab_size}")
    for name, ids in (("stop_token_ids", stopping.stop_token_ids), ("logit_bias", r.parameters.logit_bias.keys())):
        if any(t >= lim.vocab_size for t in ids):
            raise invalid(f"request {rid}: {name} has a token id >= vocab_size {lim.vocab_size}")
    try:
        params = SamplingParams.from_pb(r.parameters) if r.HasField("parameters") else SamplingParams()
    except ValueError as e:
        raise invalid(f"request {rid}: {e}") from None
    generator = None
    if params.seed is not None and not params.greedy:
        generator = torch.Generator(device=lim.device)
        generator.manual_seed(params.seed)
    penalties = None
    if params.has_penalties:
        penalties = PenaltyState.from_tokens(r.input_ids, n - r.generated_len, lim.vocab_size, lim.device)
    return RequestState(
        id=rid,
        token_ids=list(r.input_ids),
        prompt_len=n - r.generated_len,
        computed=num_computed,
        max_new_tokens=stopping.max_new_tokens,
        ignore_eos=stopping.ignore_eos_token,
        params=params,
        generator=generator,
        block_table=[],  # apply_step installs the step's blocks
        top_n=r.top_n_tokens,
        prefill_logprobs=r.prefill_logprobs,
        penalties=penalties,
        draft_len=num_computed,  # every target prefill is mirrored in the draft pool, cached blocks included
        min_new_tokens=stopping.min_new_tokens,
        stop_token_ids=frozenset(stopping.stop_token_ids),
        prompt_top_n=r.prompt_top_n if r.prefill_logprobs else 0,
    )
