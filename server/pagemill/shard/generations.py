"""What one step produced per request, and turning it into pb.Generations.

A request finishes on EOS (unless ignore_eos_token; a constrained request
always ends on the EOS its finished grammar forces), on one of its
stop_token_ids, or when it has generated max_new_tokens; EOS and stop tokens
win over the length. Before min_new_tokens the sampler never draws EOS or a
stop token (engine.banned_tokens). A finish inside an accepted
speculative run truncates the run there. A request with `error` set gets a
Generation carrying only that error and is dropped.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagemill.proto import pb
from pagemill.shard.batch import RequestState, ShardBatch


@dataclass
class Emitted:  # what one step produced for one request
    ids: list[int]
    logprobs: list[float]
    top: list[tuple[list[int], list[float]]]


def advance(batch: ShardBatch, emitted: list[Emitted], prompt_lps: dict[int, list[float]], eos_ids) -> list:
    """Appends each request's tokens up to its first finish, builds its Generation."""
    generations, alive = [], []
    for r, e in zip(batch.requests, emitted):
        if r.error is not None:
            generations.append(pb.Generation(request_id=r.id, error=r.error))
            continue
        prefill_tokens = pb.Tokens(ids=r.token_ids, logprobs=prompt_lps[r.id]) if r.id in prompt_lps else None
        # Everything fed this step is in the pool: the last token and the accepted proposals.
        r.cache_len = r.seq_len + len(e.ids) - 1
        finish, n = pb.FINISH_REASON_UNSPECIFIED, 0
        for token in e.ids:
            n += 1
            r.token_ids.append(token)
            r.generated += 1
            if r.grammar is not None and (err := r.grammar.consume([token])) is not None:
                r.error = err
                break
            finish = finish_reason(r, token, eos_ids)
            if finish != pb.FINISH_REASON_UNSPECIFIED:
                break  # a finish inside an accepted run truncates it there
        if r.error is not None:
            generations.append(pb.Generation(request_id=r.id, error=r.error))
            continue
        if r.penalties is not None:
            r.penalties.add(e.ids[:n])
        generations.append(
            pb.Generation(
                request_id=r.id,
                prefill_tokens=prefill_tokens,
                tokens=pb.Tokens(ids=e.ids[:n], logprobs=e.logprobs[:n]),
                top_tokens=[pb.Tokens(ids=i, logprobs=lp) for i, lp in e.top[:n]] if r.top_n else [],
                finish_reason=finish,
            )
        )
        if finish == pb.FINISH_REASON_UNSPECIFIED:
            alive.append(r)
    batch.requests = alive
    return generations

def finish_reason(r: RequestState, token: int, eos_ids) -> int:
    # A finished grammar only allows EOS, which then ends the request even with ignore_eos.
    if token in eos_ids and (not r.ignore_eos or r.grammar is not None):
        return pb.FINISH_REASON_EOS_TOKEN
    if token in r.stop_token_ids:
        return pb.FINISH_REASON_STOP_SEQUENCE
    if r.generated >= r.max_new_tokens:
        return pb.FINISH_REASON_LENGTH
    return pb.FINISH_REASON_UNSPECIFIED
