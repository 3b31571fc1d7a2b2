"""Per-request sampling controls, decoded and validated from the proto."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1: off
    typical_p: float = 1.0  # 1: off
    min_p: float = 0.0  # 0: off
    do_sample: bool = False
    seed: int | None = None  # None: the shard's shared generator
    repetition_penalty: float = 1.0  # 1: off; HF/CTRL rule over the whole context
    frequency_penalty: float = 0.0  # OpenAI rule over generated tokens
    presence_penalty: float = 0.0  # OpenAI rule over generated tokens
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) added to the logits; OpenAI's logit_bias

    @property
    def greedy(self) -> bool:
        """Argmax instead of a draw: exactly when do_sample is off.

        The router decides do_sample (router/src/validation.rs folds TGI's rule
        that any sampling knob implies sampling into it); the shard obeys the
        flag. Temperature 0 is argmax too: there is no distribution to draw from.
        """
        return self.temperature == 0.0 or not self.do_sample

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0

    @classmethod
    def from_pb(cls, p) -> "SamplingParams":
        """From pb.NextTokenChooserParameters; raises ValueError on nonsense.

        proto3 cannot tell an unset float from 0, so 0 for top_p, typical_p
        and repetition_penalty (whose "off" value is 1) is read as off too.
        """
        for name in ("temperature", "top_p", "typical_p", "min_p", "repetition_penalty",
                     "frequency_penalty", "presence_penalty"):  # fmt: skip
            if not math.isfinite(getattr(p, name)):
                raise ValueError(f"{name} must be finite, got {getattr(p, name)}")
        if p.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {p.temperature}")
        if p.top_p < 0 or p.typical_p < 0:
            raise ValueError(f"top_p and typical_p must be in [0, 1], got {p.top_p} and {p.typical_p}")
        if not 0 <= p.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {p.min_p}")
        if p.repetition_penalty < 0:
            raise ValueError(f"repetition_penalty must be > 0, got {p.repetition_penalty}")
        for token, bias in p.logit_bias.items():
            if not math.isfinite(bias):
                raise ValueError(f"logit_bias of token {token} must be finite, got {bias}")

        def off_at_one(x: float) -> float:
            return 1.0 if x <= 0 or x >= 1 else float(x)

        return cls(
            temperature=float(p.temperature),
            top_k=int(p.top_k),
            top_p=off_at_one(p.top_p),
            typical_p=off_at_one(p.typical_p),
            min_p=float(p.min_p),
            do_sample=bool(p.do_sample),
            seed=int(p.seed) if p.has_seed else None,
            repetition_penalty=float(p.repetition_penalty) if p.repetition_penalty > 0 else 1.0,
            frequency_penalty=float(p.frequency_penalty),
            presence_penalty=float(p.presence_penalty),
            logit_bias=tuple(sorted((int(t), float(b)) for t, b in p.logit_bias.items())),
        )
