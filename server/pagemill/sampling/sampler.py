"""Batched next-token choice for requests with different sampling controls.

Pipeline per step, in Hugging Face's order:
    penalties (repetition, then frequency/presence) -> temperature
    -> top-k -> top-p -> min-p -> typical-p -> draw (or argmax when greedy).

Reported logprobs are log_softmax of the logits after penalties and
temperature, *before* the truncating warpers (top-k/p, min-p, typical):
the model's distribution as the request shaped it, never -inf for a token
that a warper dropped. Greedy rows use temperature 1. Units: natural log.

Every truncating warper is vectorised over the rows that sample; a row whose
control is off is left untouched by that step, so a heterogeneous batch gives
each row exactly what it would get alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

import torch

from pagemill.sampling.params import SamplingParams

NEG_INF = float("-inf")


class SamplingRow(Protocol):
    params: SamplingParams
    generator: torch.Generator | None  # set for seeded requests
    token_ids: Sequence[int]  # whole context so far: prompt + generated
    prompt_len: int  # leading token_ids that are not generated (ignored by frequency/presence)
    top_n: int  # alternatives to report


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[float]
    top_ids: list[list[int]]  # row i has rows[i].top_n entries, best first
    top_logprobs: list[list[float]]


class Sampler:
    def __init__(self, device: torch.device | str = "cpu", seed: int | None = None) -> None:
        self.device = torch.device(device)
        # Draws of unseeded requests. Seeded requests own their generator, so
        # their tokens do not depend on who else is in the batch.
        self.generator = torch.Generator(device=self.device)
        if seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(seed)

    @torch.no_grad()
    def __call__(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> SamplerOutput:
        """logits [B, V] (float32), one row per request."""
        assert logits.shape[0] == len(rows)
        logits = logits.float()
        if any(r.params.has_penalties for r in rows):
            logits = apply_penalties(logits, rows)
        sampling = [i for i, r in enumerate(rows) if not r.params.greedy]

        if not sampling:
            # Fast path: argmax; logprob via one logsumexp, no [B, V] log_softmax.
            ids = logits.argmax(-1)
            norm = logits.logsumexp(-1, keepdim=True)
            chosen = logits.gather(1, ids[:, None]).squeeze(1) - norm.squeeze(1)
            return _output(ids, chosen, logits, norm, rows)

        temps = torch.tensor([1.0 if r.params.greedy else r.params.temperature for r in rows], device=logits.device)
        scaled = logits / temps[:, None]
        ids = scaled.argmax(-1)
        idx = torch.tensor(sampling, device=logits.device)
        warped = apply_warpers(scaled[idx], [rows[i].params for i in sampling])
        ids[idx] = self._draw(torch.softmax(warped, dim=-1), [rows[i] for i in sampling])
        norm = scaled.logsumexp(-1, keepdim=True)
        chosen = scaled.gather(1, ids[:, None]).squeeze(1) - norm.squeeze(1)
        return _output(ids, chosen, scaled, norm, rows)

    def _draw(self, probs: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        """One token per row from probs [b, V].

        Exponential race: argmax(p / E) with E ~ Exp(1) picks token i with
        probability p_i (the Gumbel-max trick). Each seeded row draws its noise
        from its own generator.
        """
        noise = torch.empty_like(probs)
        shared = [j for j, r in enumerate(rows) if r.generator is None]
        if shared:
            draws = torch.empty((len(shared), probs.shape[1]), device=probs.device)
            noise[torch.tensor(shared, device=probs.device)] = draws.exponential_(generator=self.generator)
        for j, r in enumerate(rows):
            if r.generator is not None:
                noise[j].exponential_(generator=r.generator)
        # exponential_ may return exactly 0; p = 0 must then still lose (0 / tiny = 0, not NaN).
        return (probs / noise.clamp_min_(torch.finfo(noise.dtype).tiny)).argmax(-1)


def _output(ids, chosen, logits, norm, rows) -> SamplerOutput:
    n = max(r.top_n for r in rows)
    top_ids: list[list[int]] = [[] for _ in rows]
    top_lp: list[list[float]] = [[] for _ in rows]
    if n > 0:
        values, indices = logits.topk(min(n, logits.shape[1]), dim=-1)
        values, indices = (values - norm).tolist(), indices.tolist()
        for i, r in enumerate(rows):
            top_ids[i], top_lp[i] = indices[i][: r.top_n], values[i][: r.top_n]
    return SamplerOutput(ids.tolist(), chosen.tolist(), top_ids, top_lp)


def apply_penalties(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Repetition penalty (over prompt + generated) then frequency/presence (generated only)."""
    logits = logits.clone()
    vocab = logits.shape[1]
    rep = [i for i, r in enumerate(rows) if r.params.repetition_penalty != 1.0]
    if rep:
        seen = _counts([rows[i].token_ids for i in rep], vocab, logits.device) > 0
        penalty = torch.tensor([rows[i].params.repetition_penalty for i in rep], device=logits.device)[:, None]
        sub = logits[rep]
        # CTRL rule as in HF: a seen token's logit moves towards "less likely"
        # whatever its sign (divide positives, multiply negatives).
        penalised = torch.where(sub < 0, sub * penalty, sub / penalty)
        logits[rep] = torch.where(seen, penalised, sub)
    freq = [i for i, r in enumerate(rows) if r.params.frequency_penalty != 0.0 or r.params.presence_penalty != 0.0]
    if freq:
        counts = _counts([rows[i].token_ids[rows[i].prompt_len :] for i in freq], vocab, logits.device)
        f = torch.tensor([rows[i].params.frequency_penalty for i in freq], device=logits.device)[:, None]
        p = torch.tensor([rows[i].params.presence_penalty for i in freq], device=logits.device)[:, None]
        logits[freq] -= f * counts + p * (counts > 0)
    return logits


def _counts(token_lists: Sequence[Sequence[int]], vocab: int, device) -> torch.Tensor:
    """[len(token_lists), vocab] float occurrence counts (ids >= vocab ignored)."""
    width = max((len(t) for t in token_lists), default=0)
    # Pad with `vocab`, an extra column that is dropped afterwards.
    padded = torch.full((len(token_lists), width), vocab, dtype=torch.int64)
    for i, t in enumerate(token_lists):
        padded[i, : len(t)] = torch.as_tensor(list(t), dtype=torch.int64).clamp_(max=vocab)
    padded = padded.to(device)
    counts = torch.zeros((len(token_lists), vocab + 1), device=device)
    counts.scatter_add_(1, padded, torch.ones_like(padded, dtype=counts.dtype))
    return counts[:, :vocab]


def apply_warpers(scaled: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Truncation of temperature-scaled logits [b, V]; dropped tokens become -inf."""
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
