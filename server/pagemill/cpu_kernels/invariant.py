"""Bindings of csrc/gemm/invariant_gemm.cpp and csrc/attention/invariant_attention.cpp: the
linear and the paged attention of `--batch-invariant`, every output summed in one order fixed
by its own length (csrc/common/fixed_order.h), whatever shares the call or the thread count."""

from __future__ import annotations

import ctypes

import torch

from pagemill.cpu_kernels.build import library, wrapper

_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
_KV_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float8_e4m3fn: 2, torch.float8_e5m2: 3}


class InvariantKernels:
    def __init__(self, lib: ctypes.CDLL) -> None:
        self._linear = lib.pagemill_invariant_linear
        self._linear.restype = ctypes.c_int
        self._linear.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3 + [ctypes.c_int] * 2
        self._attention = lib.pagemill_invariant_attention
        self._attention.restype = ctypes.c_int
        self._attention.argtypes = ([ctypes.c_void_p] * 6 + [ctypes.c_int64] * 6 + [ctypes.c_float, ctypes.c_int64,
                                    ctypes.c_float, ctypes.c_void_p] + [ctypes.c_int] * 3)  # fmt: skip

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x [M, K] @ weight [N, K].T (+ bias [N]); float32 or bfloat16, one dtype for all."""
        if x.dtype not in _DTYPES or weight.dtype != x.dtype or (bias is not None and bias.dtype != x.dtype):
            raise ValueError(f"invariant linear takes float32 or bfloat16 alike, got {x.dtype} and {weight.dtype}")
        x, weight = x.contiguous(), weight.contiguous()
        bias = None if bias is None else bias.contiguous()
        m, k = x.shape
        n = weight.shape[0]
        y = torch.empty((m, n), dtype=x.dtype)
        if m:
            self._linear(x.data_ptr(), weight.data_ptr(), 0 if bias is None else bias.data_ptr(), y.data_ptr(),
                         m, n, k, _DTYPES[x.dtype], torch.get_num_threads())  # fmt: skip
        return y

    def attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                  seq: torch.Tensor, pos: torch.Tensor, scale: float, window: int | None,
                  softcap: float | None) -> torch.Tensor:  # fmt: skip
        """q [T, H, D]; caches [blocks, block_size, kv_heads, D]; block_tables int32 [S, W];
        seq, pos int64 [T]: each token's sequence and absolute position."""
        if q.dtype not in _DTYPES or k_cache.dtype not in _KV_DTYPES:
            raise ValueError(f"invariant attention: no kernel for {q.dtype} queries over a {k_cache.dtype} cache")
        q = q.contiguous()
        tables = block_tables.to(torch.int32).contiguous()
        seq, pos = seq.to(torch.int64).contiguous(), pos.to(torch.int64).contiguous()
        tokens, heads, head_dim = q.shape
        block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
        out = torch.empty_like(q)
        if tokens:
            self._attention(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(), seq.data_ptr(),
                            pos.data_ptr(), tokens, heads, kv_heads, head_dim, block_size, tables.shape[1], scale,
                            window or 0, softcap or 0.0, out.data_ptr(), _DTYPES[q.dtype], _KV_DTYPES[k_cache.dtype],
                            torch.get_num_threads())  # fmt: skip
        return out


def invariant_kernels() -> InvariantKernels | None:
    """The process-wide bindings, built or loaded on first call; None where unavailable."""
    lib = library()
    return None if lib is None else wrapper("invariant", InvariantKernels, lib)
