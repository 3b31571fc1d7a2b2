"""ctypes wrapper of gemm_bf16.cpp (bfloat16 linears from 2 rows up) and its weight packing."""

from __future__ import annotations

import ctypes

import torch
import torch.nn.functional as F

from pagemill.cpu_kernels.build import library, wrapper

# Output channels per packed block and activations per 32-bit lane (gemm_bf16.h's layout).
BLOCK_N = 16
PAIR_K = 2


def pack_bf16(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] bf16 -> [ceil(N/16), ceil(K/2), 16, 2] (zero padded), the layout the kernel reads."""
    n, k = weight.shape
    np_, kp = -(-n // BLOCK_N) * BLOCK_N, -(-k // PAIR_K) * PAIR_K
    w = F.pad(weight.detach(), (0, kp - k, 0, np_ - n))
    return w.view(np_ // BLOCK_N, BLOCK_N, kp // PAIR_K, PAIR_K).permute(0, 2, 1, 3).contiguous()


def interleave_swiglu(t: torch.Tensor) -> torch.Tensor:
    """An MLP's gate_up rows [2I, ...] (gate, then up) -> 16-row blocks alternating gate and up
    (gate 0-15, up 0-15, gate 16-31, ...), the order the SwiGLU epilogue reads; I % 16 == 0."""
    i = t.shape[0] // 2
    return t.reshape(2, i // BLOCK_N, BLOCK_N, *t.shape[1:]).transpose(0, 1).reshape(t.shape)


def pack_swiglu(weight: torch.Tensor) -> torch.Tensor:
    """gate_up [2I, K] bf16 (I % 16 == 0) -> pack_bf16 of its interleaved rows."""
    return pack_bf16(interleave_swiglu(weight.detach()))


class GemmBf16Kernel:
    """y = x @ w.T (+ bias) for bfloat16 rows against a pack_bf16 weight."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        vp, i64 = ctypes.c_void_p, ctypes.c_int64
        self._fn = lib.pagemill_gemm_bf16
        self._fn.restype = ctypes.c_int
        self._fn.argtypes = [vp, i64, vp, vp, vp, i64, i64, i64, i64, ctypes.c_int]
        # Whether the AVX512-BF16 path was compiled in (else the portable loop, for tests only).
        self.fast = bool(lib.pagemill_gemm_bf16_fast())
        # Whether calls of 4+ rows multiply on AMX tiles (gemm_amx.h): built in and granted.
        self.amx = self.fast and bool(lib.pagemill_gemm_bf16_amx())
        self._swiglu = lib.pagemill_gemm_bf16_swiglu
        self._swiglu.restype = ctypes.c_int
        self._swiglu.argtypes = self._fn.argtypes

    def __call__(self, x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None,
                 out_features: int) -> torch.Tensor:  # fmt: skip
        """x [M, K] bf16 (unit stride in K), packed from pack_bf16 of an [out_features, K] weight,
        bias bf16 [out_features] or None -> [M, out_features] bf16."""
        if x.dtype != torch.bfloat16 or x.dim() != 2 or x.stride(1) != 1:
            raise ValueError(f"bf16 gemm takes 2-d bfloat16 rows of unit stride, got {x.dtype} {tuple(x.shape)}")
        m, k = x.shape
        kp = packed.shape[1] * PAIR_K
        if kp != k:  # an odd K: the packed weight has a zero column the rows must match
            x = F.pad(x, (0, kp - k))
        y = torch.empty((m, out_features), dtype=torch.bfloat16)
        rc = self._fn(x.data_ptr(), x.stride(0), packed.data_ptr(), 0 if bias is None else bias.data_ptr(),
                      y.data_ptr(), out_features, m, out_features, kp, torch.get_num_threads())  # fmt: skip
        if rc != 0:
            raise ValueError(f"bf16 gemm rejected x {tuple(x.shape)}, {out_features} outputs")
        return y

    def swiglu(self, x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x [M, K] bf16 (unit stride in K, K even), packed from pack_swiglu of a [2I, K] gate_up,
        bias interleave_swiglu of its [2I] bias or None -> silu(gate) * up [M, I] bf16, rounded as
        the GEMM and then the separate silu * up pass round (AVX512-BF16 builds only)."""
        if x.dtype != torch.bfloat16 or x.dim() != 2 or x.stride(1) != 1:
            raise ValueError(f"bf16 swiglu takes 2-d bfloat16 rows of unit stride, got {x.dtype} {tuple(x.shape)}")
        m, k = x.shape
        n = packed.shape[0] * BLOCK_N
        if packed.shape[1] * PAIR_K != k:
            raise ValueError(f"bf16 swiglu: x has {k} features, the packed weight {packed.shape[1] * PAIR_K}")
        y = torch.empty((m, n // 2), dtype=torch.bfloat16)
        rc = self._swiglu(x.data_ptr(), x.stride(0), packed.data_ptr(), 0 if bias is None else bias.data_ptr(),
                          y.data_ptr(), n // 2, m, n, k, torch.get_num_threads())  # fmt: skip
        if rc != 0:
            raise ValueError(f"bf16 swiglu rejected x {tuple(x.shape)} against {n} gate_up rows (rc={rc})")
        return y


def gemm_bf16_kernel() -> GemmBf16Kernel | None:
    """The process-wide bf16 gemm, built or loaded on first call; None where unavailable."""
    lib = library()
    return None if lib is None else wrapper("gemm_bf16", GemmBf16Kernel, lib)
