"""Truncating warpers over temperature-scaled logits, vectorised over rows.

A row whose control is off is left untouched by that step, so each row of a
heterogeneous batch gets exactly what it would get alone. Order and tie
rules follow Hugging Face's logits warpers.
"""

from __future__ import annotations

from typing import Sequence

import torch

from pagemill.sampling.params import SamplingParams

NEG_INF = float("-inf")


def apply_warpers(scaled: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """top-k -> top-p -> min-p -> typical-p on [b, V]; dropped tokens become -inf."""
    dev = scaled.device
    if any(p.top_k > 0 for p in params):
        scaled = top_k(scaled, torch.tensor([p.top_k for p in params], device=dev))
    if any(p.top_p < 1.0 for p in params):
        scaled = top_p(scaled, torch.tensor([p.top_p for p in params], device=dev))
    if any(p.min_p > 0.0 for p in params):
        scaled = min_p(scaled, torch.tensor([p.min_p for p in params], device=dev))
    if any(p.typical_p < 1.0 for p in params):
        scaled = typical_p(scaled, torch.tensor([p.typical_p for p in params], device=dev))
    return scaled


def top_k(logits: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Keeps each row's k largest logits (ties at the k-th kept); k <= 0 keeps all."""
    on = (k > 0) & (k < logits.shape[1])
    if not bool(on.any()):
        return logits
    # topk only as wide as the largest active k: rows with top-k off must not force a full sort.
    k = torch.where(on, k, 1).long()
    kth = logits.topk(int(k.max()), dim=-1).values.gather(1, (k - 1)[:, None])
    kth = kth.masked_fill(~on[:, None], NEG_INF)
    return logits.masked_fill(logits < kth, NEG_INF)


def top_p(logits: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """Nucleus: keeps the smallest set of top tokens with mass >= p; p >= 1 keeps all."""
    sorted_logits, order = logits.sort(dim=-1)  # ascending
    cumulative = sorted_logits.softmax(-1).cumsum(-1)
    drop = cumulative <= (1 - p)[:, None]
    drop[:, -1] = False  # always keep the most likely token
    drop &= (p < 1.0)[:, None]
    return logits.masked_fill(drop.scatter(1, order, drop), NEG_INF)


def min_p(logits: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """Drops tokens less likely than m times the most likely one."""
    probs = logits.softmax(-1)
    drop = probs < m[:, None] * probs.amax(-1, keepdim=True)
    drop.scatter_(1, probs.argmax(-1, keepdim=True), False)
    return logits.masked_fill(drop, NEG_INF)


def typical_p(logits: torch.Tensor, mass: torch.Tensor) -> torch.Tensor:
    """Locally typical sampling: keeps tokens whose surprise is closest to the
    entropy, up to probability `mass`; mass >= 1 keeps all."""
    logp = logits.log_softmax(-1)
    entropy = -(logp * logp.exp()).nansum(-1, keepdim=True)
    distance = (-logp - entropy).abs()
    sorted_distance, order = distance.sort(dim=-1)
    cumulative = logits.gather(1, order).softmax(-1).cumsum(-1)
    last = (cumulative < mass[:, None]).sum(1).clamp_(max=logits.shape[1] - 1)
    drop = sorted_distance > sorted_distance.gather(1, last[:, None])
    drop[:, 0] = False
    drop &= (mass < 1.0)[:, None]
    return logits.masked_fill(drop.scatter(1, order, drop), NEG_INF)
