"""What one step produced per request, and turning it into a pb.Generation.

The one place a request finishes on length, EOS or a stop token: the router
sends the stopping criteria (what is left of max_new_tokens, ignore_eos,
min_new_tokens, stop_token_ids), takes the finish reason from here, and only
checks that a reply never runs past max_new_tokens. Stop strings are text,
matched by the router's per-request stream (router/src/stream.rs).

A request finishes on EOS (unless ignore_eos_token; a constrained request
always ends on the EOS its finished grammar forces), on one of its
stop_token_ids, or when it has generated max_new_tokens; EOS and stop tokens
win over the length. Before min_new_tokens the sampler never draws EOS or a
stop token (constraints.banned_tokens). A finish inside an accepted
speculative run truncates the run there. A request with `error` set gets a
Generation carrying only that error and is dropped.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagemill.proto import pb
from pagemill.shard.requests import Entry, RequestState


@dataclass
class Emitted:  # what one step sampled for one request
    ids: list[int]
    logprobs: list[float]
    top: list[tuple[list[int], list[float]]]


def advance(e: Entry, emitted: Emitted | None, prompt_lps, eos_ids) -> tuple[object, bool]:
    """Appends the entry's tokens up to its first finish; returns its Generation and
    whether the shard keeps the request (False: finished or failed). prompt_lps: the
    pb.PromptLogprobs this step computed for the entry, if any."""
    r = e.state
    if r is None or r.error is not None:
        return pb.Generation(request_id=e.id, error=e.error if r is None else r.error), False
    if emitted is None:  # an intermediate prompt chunk: nothing sampled
        r.computed = e.end
        return pb.Generation(request_id=e.id, prompt_logprobs=prompt_lps), True
    # Everything fed this step is in the pool: the range and the accepted proposals.
    r.computed = e.end + len(emitted.ids) - 1
    finish, n = pb.FINISH_REASON_UNSPECIFIED, 0
    for token in emitted.ids:
        n += 1
        r.token_ids.append(token)
        r.generated += 1
        if r.grammar is not None and (err := r.grammar.consume([token])) is not None:
            r.error = err
            return pb.Generation(request_id=e.id, error=err), False
        finish = finish_reason(r, token, eos_ids)
        if finish != pb.FINISH_REASON_UNSPECIFIED:
            break  # a finish inside an accepted run truncates it there
    if r.penalties is not None:
        r.penalties.add(emitted.ids[:n])
    gen = pb.Generation(
        request_id=e.id,
        prompt_logprobs=prompt_lps,
        tokens=pb.Tokens(ids=emitted.ids[:n], logprobs=emitted.logprobs[:n]),
        top_tokens=[pb.Tokens(ids=i, logprobs=lp) for i, lp in emitted.top[:n]] if r.top_n else [],
        finish_reason=finish,
    )
    return gen, finish == pb.FINISH_REASON_UNSPECIFIED


def finish_reason(r: RequestState, token: int, eos_ids) -> int:
    # A finished grammar only allows EOS, which then ends the request even with ignore_eos.
    if token in eos_ids and (not r.ignore_eos or r.grammar is not None):
        return pb.FINISH_REASON_EOS_TOKEN
    if token in r.stop_token_ids:
        return pb.FINISH_REASON_STOP_SEQUENCE
    if r.generated >= r.max_new_tokens:
        return pb.FINISH_REASON_LENGTH
    return pb.FINISH_REASON_UNSPECIFIED
