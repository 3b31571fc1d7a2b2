"""Repetition / frequency / presence penalties with incremental per-request counts.

Each penalised request keeps two [V] tensors on the device, built once from
its context at prefill and updated with the tokens of every step, so a step
costs O(new tokens) bookkeeping instead of re-counting the whole context.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

import torch

from pagemill.sampling.params import SamplingParams


@dataclass
class PenaltyState:
    seen: torch.Tensor  # bool [V]: token occurs in prompt or generated text (repetition penalty)
    counts: torch.Tensor  # float32 [V]: occurrences among generated tokens (frequency/presence)

    @classmethod
    def from_tokens(cls, token_ids: Sequence[int], prompt_len: int, vocab: int, device) -> "PenaltyState":
        ids = torch.as_tensor(list(token_ids), dtype=torch.int64, device=device).clamp_(max=vocab - 1)
        seen = torch.zeros(vocab, dtype=torch.bool, device=device)
        seen[ids] = True
        counts = torch.zeros(vocab, dtype=torch.float32, device=device)
        counts.index_add_(0, ids[prompt_len:], torch.ones_like(ids[prompt_len:], dtype=torch.float32))
        return cls(seen, counts)

    def add(self, generated: Sequence[int]) -> None:
        ids = torch.as_tensor(list(generated), dtype=torch.int64, device=self.seen.device)
        self.seen[ids] = True
        self.counts.index_add_(0, ids, torch.ones_like(ids, dtype=torch.float32))


class PenalisedRow(Protocol):
    params: SamplingParams
    penalties: PenaltyState | None


def apply_penalties(logits: torch.Tensor, rows: Sequence[PenalisedRow]) -> torch.Tensor:
    """Repetition penalty (HF/CTRL rule, whole context), then frequency/presence
    (OpenAI rule, generated tokens only). Rows without penalties are untouched."""
    idx = [i for i, r in enumerate(rows) if r.params.has_penalties]
    if not idx:
        return logits
    logits = logits.clone()
    dev = logits.device
    params = [rows[i].params for i in idx]
    seen = torch.stack([rows[i].penalties.seen for i in idx])
    counts = torch.stack([rows[i].penalties.counts for i in idx])
    sub = logits[idx]
    rep = torch.tensor([p.repetition_penalty for p in params], device=dev)[:, None]
    # A seen token moves towards "less likely" whatever its sign (divide
    # positives, multiply negatives); penalty 1 leaves it as it is.
    sub = torch.where(seen, torch.where(sub < 0, sub * rep, sub / rep), sub)
    freq = torch.tensor([p.frequency_penalty for p in params], device=dev)[:, None]
    pres = torch.tensor([p.presence_penalty for p in params], device=dev)[:, None]
    sub = sub - freq * counts - pres * (counts > 0)
    logits[idx] = sub
    return logits
