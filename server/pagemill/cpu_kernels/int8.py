"""ctypes wrapper of int8_linear.cpp (the linear of `--quantize int8`)."""

from __future__ import annotations

import ctypes

import torch

from pagemill.cpu_kernels.build import library, wrapper

# Output channels per packed block and activations per 32-bit lane (int8_linear.cpp's layout).
BLOCK_N = 16
GROUP_K = 4


class Int8LinearKernel:
    """y = dequant(quant(x) @ wq.T) (+ bias) for float32 or bfloat16 rows."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        vp, i64 = ctypes.c_void_p, ctypes.c_int64
        self._fn = lib.pagemill_int8_linear
        self._fn.restype = ctypes.c_int
        self._fn.argtypes = [vp, ctypes.c_int, vp, vp, vp, vp, vp, i64, i64, i64, i64, ctypes.c_int]
        # Whether the AVX512-VNNI path was compiled in (else the portable loop).
        self.vnni = bool(lib.pagemill_int8_vnni())
        # Whether calls of 8+ rows multiply on AMX-INT8 tiles (int8_amx.h): the same integers.
        self.amx = bool(lib.pagemill_int8_amx())

    def __call__(self, x: torch.Tensor, packed: torch.Tensor, w_scale: torch.Tensor, w_corr: torch.Tensor,
                 bias: torch.Tensor | None, out_features: int, rotate: int = 0) -> torch.Tensor:  # fmt: skip
        """x [M, K] contiguous float32/bfloat16; packed/w_scale/w_corr as quantized_linear.pack_int8
        makes them; bias float32 [N] or None; rotate: the Hadamard block the weight was rotated
        with (0: none) -> [M, N] in x's dtype."""
        if x.dtype not in (torch.float32, torch.bfloat16) or not x.is_contiguous() or x.dim() != 2:
            raise ValueError(f"int8 linear takes contiguous 2-d float32/bfloat16 rows, got {x.dtype} {tuple(x.shape)}")
        m, k = x.shape
        y = torch.empty((m, out_features), dtype=x.dtype)
        rc = self._fn(x.data_ptr(), int(x.dtype == torch.bfloat16), packed.data_ptr(), w_scale.data_ptr(),
                      w_corr.data_ptr(), 0 if bias is None else bias.data_ptr(), y.data_ptr(), m, out_features, k,
                      rotate, torch.get_num_threads())  # fmt: skip
        if rc != 0:
            raise ValueError(f"int8 linear rejected x {tuple(x.shape)}, {out_features} outputs, rotate {rotate}")
        return y


def int8_kernel() -> Int8LinearKernel | None:
    """The process-wide int8 linear, built or loaded on first call; None where unavailable."""
    lib = library()
    return None if lib is None else wrapper("int8", Int8LinearKernel, lib)
