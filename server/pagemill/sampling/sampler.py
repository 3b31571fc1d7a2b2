"""Batched next-token choice for requests with different sampling controls.

Pipeline per row, in Hugging Face's order:
    penalties (repetition, then frequency/presence) -> logit bias -> temperature
    -> grammar mask and banned tokens -> top-k -> top-p -> min-p -> typical-p
    -> draw (or argmax when greedy).

Reported logprobs are log_softmax of the logits after penalties, logit bias
and temperature, *before* the grammar mask, the banned tokens and the
truncating warpers: the model's distribution as the request shaped it, never
-inf for a token that a warper, the grammar or min_tokens dropped. Greedy
rows use temperature 1. Units: natural log.

A request usually owns one row; when speculative proposals are verified it
owns one row per position (rows then repeat the same request object).
Penalties and grammar masks are only ever applied to one-row requests.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

import torch

from pagemill.sampling.params import SamplingParams
from pagemill.sampling.bias import apply_logit_bias, ban_tokens
from pagemill.sampling.penalties import PenaltyState, apply_penalties
from pagemill.sampling.warpers import NEG_INF, apply_warpers


class SamplingRow(Protocol):
    params: SamplingParams
    generator: torch.Generator | None  # set for seeded requests
    penalties: PenaltyState | None  # set when params.has_penalties
    top_n: int  # alternatives to report


@dataclass
class GrammarMask:
    rows: list[int]  # rows the grammar constrains
    allowed: torch.Tensor  # bool [len(rows), V]


@dataclass
class Shaped:
    scaled: torch.Tensor  # [N, V] after penalties and temperature: what logprobs report
    norm: torch.Tensor  # [N, 1] logsumexp of scaled
    masked: torch.Tensor  # scaled with the grammar mask applied (scaled itself when none)


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[float]
    top_ids: list[list[int]]  # row i has rows[i].top_n entries, best first
    top_logprobs: list[list[float]]


class Sampler:
    def __init__(self, device: torch.device | str = "cpu", seed: int | None = None, greedy=None) -> None:
        """greedy: a cpu_kernels.rowwise.GreedyKernel for batches of plain greedy rows on the CPU (None: torch)."""
        self.device = torch.device(device)
        self.greedy = greedy
        # Draws of unseeded requests. Seeded requests own their generator, so
        # their tokens do not depend on who else is in the batch.
        self.generator = torch.Generator(device=self.device)
        if seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(seed)

    @torch.no_grad()
    def __call__(
        self,
        logits: torch.Tensor,
        rows: Sequence[SamplingRow],
        mask: GrammarMask | None = None,
        banned: dict[int, Sequence[int]] | None = None,
    ) -> SamplerOutput:
        """logits [N, V], one row per request: one token each, in any float dtype (read as
        float32). banned: row -> token ids it may not draw this step (EOS and stop tokens
        before min_tokens)."""
        if (self.greedy is not None and mask is None and not banned and logits.device.type == "cpu"
                and logits.dtype in (torch.float32, torch.bfloat16)):
            if all(r.params.greedy and not r.top_n and not r.params.logit_bias and not r.params.has_penalties
                   for r in rows):
                # The common case in one compiled pass (greedy.cpp), the same numbers as below.
                fast = self.greedy(logits)
                if fast is not None:
                    ids, lps = fast
                    return SamplerOutput(ids.tolist(), lps.tolist(), [[] for _ in rows], [[] for _ in rows])
        shaped = self.shape(logits, rows, mask, banned)
        ids = shaped.masked.argmax(-1)
        sampling = [i for i, r in enumerate(rows) if not r.params.greedy]
        if sampling:
            idx = torch.tensor(sampling, device=logits.device)
            warped = apply_warpers(shaped.masked[idx], [rows[i].params for i in sampling])
            ids[idx] = self.draw(torch.softmax(warped, dim=-1), [rows[i] for i in sampling])
        return self.report(ids, shaped, rows)

    def shape(
        self,
        logits: torch.Tensor,
        rows: Sequence[SamplingRow],
        mask: GrammarMask | None = None,
        banned: dict[int, Sequence[int]] | None = None,
    ) -> Shaped:
        assert logits.shape[0] == len(rows)
        logits = apply_logit_bias(apply_penalties(logits.float(), rows), [r.params for r in rows])
        if any(not r.params.greedy and r.params.temperature != 1.0 for r in rows):
            temps = [1.0 if r.params.greedy else r.params.temperature for r in rows]
            logits = logits / torch.tensor(temps, device=logits.device)[:, None]
        norm = logits.logsumexp(-1, keepdim=True)
        masked = logits
        if mask is not None and mask.rows:
            masked = logits.clone()
            idx = torch.tensor(mask.rows, device=logits.device)
            masked[idx] = logits[idx].masked_fill(~mask.allowed, NEG_INF)
        if banned:
            masked = ban_tokens(masked.clone() if masked is logits else masked, banned)
        return Shaped(logits, norm, masked)

    def target_probs(self, shaped: Shaped, rows: Sequence[SamplingRow]) -> torch.Tensor:
        """[N, V] distribution each row samples from; greedy rows are one-hot at the argmax,
        which makes the speculative rejection rule reduce to "accept while equal to argmax"."""
        masked = shaped.masked
        probs = torch.zeros_like(masked).scatter_(1, masked.argmax(-1, keepdim=True), 1.0)
        sampling = [i for i, r in enumerate(rows) if not r.params.greedy]
        if sampling:
            idx = torch.tensor(sampling, device=masked.device)
            probs[idx] = torch.softmax(apply_warpers(masked[idx], [rows[i].params for i in sampling]), dim=-1)
        return probs

    def draw(self, probs: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        """One token per row from probs [b, V]; argmax for greedy rows.

        Exponential race: argmax(p / E) with E ~ Exp(1) picks token i with
        probability p_i (the Gumbel-max trick). Each seeded row draws its noise
        from its own generator.
        """
        ids = probs.argmax(-1)
        sampling = [j for j, r in enumerate(rows) if not r.params.greedy]
        if not sampling:
            return ids
        noise = torch.empty((len(sampling), probs.shape[1]), device=probs.device)
        shared = [k for k, j in enumerate(sampling) if rows[j].generator is None]
        if shared:
            draws = torch.empty((len(shared), probs.shape[1]), device=probs.device)
            noise[torch.tensor(shared, device=probs.device)] = draws.exponential_(generator=self.generator)
        for k, j in enumerate(sampling):
            if rows[j].generator is not None:
                noise[k].exponential_(generator=rows[j].generator)
        idx = torch.tensor(sampling, device=probs.device)
        # exponential_ may return exactly 0; p = 0 must then still lose (0 / tiny = 0, not NaN).
        ids[idx] = (probs[idx] / noise.clamp_min_(torch.finfo(noise.dtype).tiny)).argmax(-1)
        return ids

    def uniform(self, rows: Sequence[SamplingRow], counts: Sequence[int], width: int) -> torch.Tensor:
        """[len(rows), width] U(0, 1) draws for acceptance tests, counts[i] of them for row i
        (a seeded request must consume the same randomness whoever shares its batch);
        0.5 elsewhere and for greedy rows, whose acceptance ratios are exactly 0 or 1."""
        u = torch.full((len(rows), width), 0.5, device=self.device)
        for i, (r, n) in enumerate(zip(rows, counts)):
            if n > 0 and not r.params.greedy:
                g = r.generator if r.generator is not None else self.generator
                u[i, :n] = torch.rand(n, generator=g, device=self.device)
        return u

    def report(self, ids: torch.Tensor, shaped: Shaped, rows: Sequence[SamplingRow]) -> SamplerOutput:
        """Logprob of ids[i] and the top-n alternatives of each row."""
        chosen = shaped.scaled.gather(1, ids[:, None]) - shaped.norm
        n = max((r.top_n for r in rows), default=0)
        top_ids: list[list[int]] = [[] for _ in rows]
        top_lp: list[list[float]] = [[] for _ in rows]
        if n > 0:
            values, indices = shaped.scaled.topk(min(n, shaped.scaled.shape[1]), dim=-1)
            values, indices = (values - shaped.norm).tolist(), indices.tolist()
            for i, r in enumerate(rows):
                top_ids[i], top_lp[i] = indices[i][: r.top_n], values[i][: r.top_n]
        return SamplerOutput(ids.tolist(), chosen.squeeze(1).tolist(), top_ids, top_lp)
