"""Per-request sampling controls and the batched sampler."""

from pagemill.sampling.params import SamplingParams
from pagemill.sampling.sampler import Sampler, SamplerOutput

__all__ = ["Sampler", "SamplerOutput", "SamplingParams"]
