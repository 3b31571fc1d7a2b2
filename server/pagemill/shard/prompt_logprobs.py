"""Prompt logprobs (TGI's decoder_input_details, OpenAI's echo with logprobs, vLLM's
prompt_logprobs): the raw-logit log_softmax of each prompt token given every token before it,
its rank in the vocabulary and, when asked, the top alternatives at its position.

The row fed at position p predicts token p + 1, so a step computing start..end of a prompt
reports positions start + 1 .. end: the last of them is the next chunk's first token, whose
predecessor only this step computes. Nothing is lost at chunk boundaries; the router joins the
pieces and fills the positions of a cached prefix from what it stored beside the blocks."""

from __future__ import annotations

import torch

from pagemill.proto import pb
from pagemill.shard.requests import Entry

# Rows scored per pass: bounds the float32 [rows, vocab] logits of a long prompt.
ROWS_PER_PASS = 256


def prompt_rows(e: Entry) -> int:
    """How many of this entry's fed rows predict a prompt token it must report."""
    r = e.state
    if r is None or not r.prefill_logprobs or r.error is not None:
        return 0
    return max(0, min(e.end, r.prompt_len - 1) - e.start)


def prompt_logprobs(model, live: list[Entry], hidden: torch.Tensor | None) -> dict[int, pb.PromptLogprobs]:
    """By request id, for the entries with prompt rows to report. hidden: the step's packed rows
    (one per fed token); only read when some entry has such rows."""
    result: dict[int, pb.PromptLogprobs] = {}
    row = 0
    for e in live:
        n = prompt_rows(e)
        if n:
            if hidden is None:
                raise RuntimeError(f"request {e.id}: prompt logprobs need the step's hidden rows")
            targets = e.state.token_ids[e.start + 1 : e.start + 1 + n]
            result[e.id] = score(model, hidden[row : row + n], targets, e.state.prompt_top_n, e.start + 1)
        row += e.num_tokens + len(e.proposals)
    return result


def score(model, rows: torch.Tensor, targets: list[int], top_n: int, first: int) -> pb.PromptLogprobs:
    """Logprob and rank of targets[i] under rows[i]'s logits, and the top_n alternatives. The
    chosen token's value and the alternatives come from one tensor: a greedy token's logprob
    equals the best alternative's exactly."""
    out = pb.PromptLogprobs(first=first)
    for i in range(0, len(targets), ROWS_PER_PASS):
        lps = model.compute_logits(rows[i : i + ROWS_PER_PASS]).log_softmax(-1)
        t = torch.tensor(targets[i : i + ROWS_PER_PASS], device=lps.device)[:, None]
        chosen = lps.gather(1, t)
        out.logprobs.extend(chosen.squeeze(1).tolist())
        out.ranks.extend(((lps > chosen).sum(1) + 1).tolist())
        if top_n:
            values, ids = lps.topk(min(top_n, lps.shape[-1]), dim=-1)
            out.top.extend(pb.Tokens(ids=i_, logprobs=v) for i_, v in zip(ids.tolist(), values.tolist()))
    return out
