"""Launch-side helpers shared by the kernels."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def head_block(head_dim: int) -> int:
    # tl.arange needs a power of two and tl.dot a dimension of at least 16;
    # lanes past head_dim are masked on load and store.
    return max(16, triton.next_power_of_2(head_dim))


def dot_precision(dtype: torch.dtype) -> str:
    # fp32 inputs would run tl.dot in TF32 by default (10-bit mantissa, ~1e-3
    # relative error): "ieee" keeps fp32 exact. It is ignored for fp16/bf16,
    # which always multiply in their own type and accumulate in fp32.
    return "ieee" if dtype == torch.float32 else "tf32"


def check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """The kernels index one K/V layer as [block, slot-in-block, kv head, dim]."""
    if k_cache.shape != v_cache.shape or k_cache.stride() != v_cache.stride():
        raise ValueError("k_cache and v_cache must have the same shape and strides")
    if k_cache.stride(-1) != 1 or k_cache.stride(0) != k_cache.shape[1] * k_cache.stride(1):
        raise ValueError("KV cache layers must be [num_blocks, block_size, kv_heads, head_dim] with dense blocks")


NO_WINDOW = 1 << 30  # the window a global layer passes: longer than any context


def window_arg(window: int | None) -> int:
    """The kernels' window argument: a key is visible to a query iff key > query - window."""
    return NO_WINDOW if window is None else int(window)


@triton.jit
def soft_cap(s, SOFTCAP: tl.constexpr):
    """SOFTCAP * tanh(s / SOFTCAP) (Gemma 2's attention-logit capping); s itself when SOFTCAP is 0.
    tanh through exp2, which every Triton backend and the interpreter have."""
    if SOFTCAP > 0:
        e = tl.exp2(s * (2.0 * 1.4426950408889634 / SOFTCAP))
        s = SOFTCAP * (1.0 - 2.0 / (e + 1.0))
    return s
