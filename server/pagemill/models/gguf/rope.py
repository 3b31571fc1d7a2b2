"""Rotary scalings that llama.cpp stores as tensors rather than metadata, read back into the
Hugging Face rope_scaling dicts models/config.py understands.

Llama 3.1+: llama.cpp's converter computes one divisor per frequency from rope_scaling (factor,
low_freq_factor, high_freq_factor, original_max_position_embeddings) and writes them as
rope_freqs.weight. The divisors do not name those parameters, so the ones Llama 3.x ships (and
llama.cpp's defaults) are tried and kept where they reproduce every divisor.
Phi-3 (LongRoPE): rope_factors_long / rope_factors_short are the long_factor / short_factor lists.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from pagemill.models.gguf.reader import GGUFModel
from pagemill.models.gguf.types import F32, GGUFError

# (low_freq_factor, high_freq_factor, original_max_position_embeddings) of the Llama 3.x releases.
_LLAMA3_CANDIDATES = ((1.0, 4.0, 8192),)


def _f32_vector(g: GGUFModel, name: str) -> np.ndarray:
    t = g.info(name)
    if t.type.id != F32:
        raise GGUFError(f"{name} is {t.type.name}; llama.cpp writes it as F32")
    return g.read_bytes(name).view(np.float32).reshape(-1)


def llama3_divisors(theta: float, head_dim: int, factor: float, low: float, high: float, old: int) -> list[float]:
    """llama.cpp's converter's rope_freqs for a llama3 rope_scaling."""
    out = []
    for i in range(0, head_dim, 2):
        freq = 1.0 / (theta ** (i / head_dim))
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return out


def llama3_rope_scaling(g: GGUFModel, theta: float, head_dim: int) -> dict[str, Any]:
    divisors = _f32_vector(g, "rope_freqs.weight")
    if divisors.size != head_dim // 2:
        raise GGUFError(f"rope_freqs.weight has {divisors.size} entries, head_dim {head_dim} needs {head_dim // 2}")
    factor = float(divisors.max())
    for low, high, old in _LLAMA3_CANDIDATES:
        expect = np.array(llama3_divisors(theta, head_dim, factor, low, high, old), dtype=np.float32)
        if np.allclose(expect, divisors, rtol=1e-5, atol=0):
            return {"rope_type": "llama3", "factor": factor, "low_freq_factor": low, "high_freq_factor": high,
                    "original_max_position_embeddings": old}  # fmt: skip
    raise GGUFError("rope_freqs.weight matches no llama3 rope scaling pagemill knows (low/high frequency factors "
                    f"{[c[:2] for c in _LLAMA3_CANDIDATES]} at 8192 positions): not supported")


def longrope_scaling(g: GGUFModel, attn_factor: float | None) -> dict[str, Any]:
    out: dict[str, Any] = {
        "rope_type": "longrope",
        "long_factor": _f32_vector(g, "rope_factors_long.weight").tolist(),
        "short_factor": _f32_vector(g, "rope_factors_short.weight").tolist(),
    }
    if attn_factor is not None:
        out["attention_factor"] = float(np.float32(attn_factor))
    return out
