"""OpenAI's logit_bias, and tokens a row may not draw this step (vLLM's min_tokens).

Both are sparse (a few token ids per row), so each is one indexed write over
the whole batch rather than a dense [N, V] tensor per request.
"""

from __future__ import annotations

from typing import Sequence

import torch

from pagemill.sampling.params import SamplingParams
from pagemill.sampling.warpers import NEG_INF


def apply_logit_bias(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Adds each row's (token, bias) pairs to its logits; rows without bias are untouched."""
    rows = [i for i, p in enumerate(params) for _ in p.logit_bias]
    if not rows:
        return logits
    tokens = [t for p in params for t, _ in p.logit_bias]
    bias = [b for p in params for _, b in p.logit_bias]
    dev = logits.device
    out = logits.clone()  # the caller's tensor may be the model's output buffer
    out.index_put_((torch.tensor(rows, device=dev), torch.tensor(tokens, device=dev)),
                   torch.tensor(bias, device=dev, dtype=out.dtype), accumulate=True)
    return out


def ban_tokens(logits: torch.Tensor, banned: dict[int, Sequence[int]]) -> torch.Tensor:
    """Sets logits[row, token] to -inf for each row's banned tokens, in place."""
    rows = [r for r, ids in banned.items() for _ in ids]
    if rows:
        tokens = [t for ids in banned.values() for t in ids]
        dev = logits.device
        logits[torch.tensor(rows, device=dev), torch.tensor(tokens, device=dev)] = NEG_INF
    return logits
