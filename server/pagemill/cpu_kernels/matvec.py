"""Binding of csrc/gemm/matvec.cpp: the linear of 1..max_rows rows, float32 or bfloat16."""

from __future__ import annotations

import ctypes

import torch

from pagemill.cpu_kernels.build import library, wrapper

# How the bf16 kernels multiply (bf16_rows.h's Bf16Mul); AUTO: the measured default.
BF16_MUL = {"auto": -1, "dpbf16": 0, "widen": 1}



class MatvecKernel:
    """y = x @ w.T (+ bias) for 1..max_rows rows of float32 or bfloat16 (x, weight and
    bias of one dtype), through the compiled library."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._fn = lib.pagemill_matvec
        self._fn.restype = ctypes.c_int
        self._fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3 + [ctypes.c_int]
        self._bf16 = lib.pagemill_matvec_bf16
        self._bf16.restype = ctypes.c_int
        self._bf16.argtypes = self._fn.argtypes + [ctypes.c_int]
        self.max_rows = int(lib.pagemill_matvec_max_rows())

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                 mul: str = "auto") -> torch.Tensor:  # fmt: skip
        """x [M, K] contiguous float32 or bfloat16 CPU, weight [N, K] contiguous, bias [N] or None.
        mul: bf16 only, how to multiply (BF16_MUL; benchmarks compare them)."""
        m, k = x.shape
        n = weight.shape[0]
        y = torch.empty((m, n), dtype=x.dtype)
        args = (x.data_ptr(), weight.data_ptr(), 0 if bias is None else bias.data_ptr(), y.data_ptr(), m, n, k,
                torch.get_num_threads())  # fmt: skip
        rc = self._bf16(*args, BF16_MUL[mul]) if x.dtype == torch.bfloat16 else self._fn(*args)
        if rc != 0:
            raise ValueError(f"matvec kernel takes 1..{self.max_rows} rows, got {m}")
        return y


def matvec_kernel() -> MatvecKernel | None:
    """The process-wide matvec, built or loaded on first call; None where unavailable."""
    lib = library()
    return None if lib is None else wrapper("matvec", MatvecKernel, lib)
