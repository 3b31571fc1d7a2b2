"""Fused KV write: k and v of the packed new tokens into the pool at slot_mapping."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagemill.attention.kernels.common import check_cache
from pagemill.attention.kv_dtype import is_fp8


@triton.jit
def _write_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_slot, stride_ch,
    KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    FP8_MAX: tl.constexpr,
):  # fmt: skip
    # One program per token moves all of its kv heads for K and V: a few KiB,
    # a pure copy, so the only goal is one launch for both tensors.
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)  # pools can exceed 2**31 elements
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (h < KV_HEADS) & (d < HEAD_DIM)
    dst = slot * stride_slot + h * stride_ch + d
    k = tl.load(k_ptr + t * stride_kt + h * stride_kh + d, mask=mask)
    v = tl.load(v_ptr + t * stride_vt + h * stride_vh + d, mask=mask)
    if FP8_MAX > 0:  # an fp8 pool: saturate instead of overflowing to NaN/inf (attention/kv_dtype.py)
        k = tl.clamp(k.to(tl.float32), -FP8_MAX, FP8_MAX)
        v = tl.clamp(v.to(tl.float32), -FP8_MAX, FP8_MAX)
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """k/v [T, kv_heads, head_dim] (any row/head strides) -> cache slots slot_mapping[T]."""
    check_cache(k_cache, v_cache)
    tokens, kv_heads, head_dim = k.shape
    if tokens == 0:
        return
    if k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("k and v need a contiguous last dimension")
    _write_kv_kernel[(tokens,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(1), k_cache.stride(2),
        KV_HEADS=kv_heads, HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(kv_heads), BLOCK_D=triton.next_power_of_2(head_dim),
        FP8_MAX=torch.finfo(k_cache.dtype).max if is_fp8(k_cache.dtype) else 0.0,
    )  # fmt: skip
