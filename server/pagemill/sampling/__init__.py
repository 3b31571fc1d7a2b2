"""Per-request sampling controls and the batched sampler."""

from pagemill.sampling.bias import apply_logit_bias, ban_tokens
from pagemill.sampling.params import SamplingParams
from pagemill.sampling.penalties import PenaltyState, apply_penalties
from pagemill.sampling.sampler import GrammarMask, Sampler, SamplerOutput
from pagemill.sampling.warpers import apply_warpers

__all__ = ["GrammarMask", "PenaltyState", "Sampler", "SamplerOutput", "SamplingParams", "apply_logit_bias",
           "apply_penalties", "apply_warpers", "ban_tokens"]
