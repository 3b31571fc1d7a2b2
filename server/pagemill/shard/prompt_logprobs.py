"""Prompt logprobs (TGI's decoder_input_details): the raw-logit log_softmax of each prompt
token given its prefix, reported on the step whose range ends the prompt."""

from __future__ import annotations

import math

import torch

from pagemill.shard.requests import Entry, RequestState


def wants_prompt_logprobs(r: RequestState) -> bool:
    """Asked for and not reported yet (the first token sampled here reports them)."""
    return r.prefill_logprobs and r.generated == 0 and r.error is None


def prompt_logprobs(model, live: list[Entry], hidden: torch.Tensor | None) -> dict[int, list[float]]:
    """By request id, for the sampled entries that want them. hidden: the step's packed rows
    (one per fed token; only read for entries feeding more than one). NaN for the first
    token and for tokens whose predecessor was computed in an earlier step (its logits
    are gone)."""
    result: dict[int, list[float]] = {}
    row = 0
    for e in live:
        r = e.state
        if e.sampled and wants_prompt_logprobs(r):
            lps = [math.nan] * (e.start + 1)
            if e.num_tokens > 1:
                logits = model.compute_logits(hidden[row : row + e.num_tokens - 1])
                targets = torch.tensor(r.token_ids[e.start + 1 : e.end], device=logits.device)
                lps += logits.log_softmax(-1).gather(1, targets[:, None]).squeeze(1).tolist()
            result[e.id] = lps
        row += e.num_tokens
    return result
