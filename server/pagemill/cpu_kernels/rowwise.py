"""ctypes wrappers of the row-wise kernels: greedy.cpp (argmax and its logprob), norm.cpp
(RMSNorm, with the residual add before it) and elementwise.cpp (SwiGLU, rotary)."""

from __future__ import annotations

import ctypes

import torch

from pagemill.cpu_kernels.build import library, wrapper


class GreedyKernel:
    """greedy.cpp: argmax and its logprob per row of float32/bfloat16 logits."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._fn = lib.pagemill_greedy
        self._fn.restype = ctypes.c_int
        i64 = ctypes.c_int64
        self._fn.argtypes = [ctypes.c_void_p, ctypes.c_int, i64, i64, i64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]

    def __call__(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """logits [N, V] (unit stride in V) -> (ids int64 [N], logprobs float32 [N]), or None
        when a row holds a NaN or an infinity (the caller's torch path defines those)."""
        if logits.dim() != 2 or logits.stride(1) != 1 or logits.dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"greedy kernel takes [N, V] float32/bfloat16 rows, got {logits.dtype} {logits.shape}")
        n, v = logits.shape
        ids, lps = torch.empty(n, dtype=torch.int64), torch.empty(n, dtype=torch.float32)
        rc = self._fn(logits.data_ptr(), int(logits.dtype == torch.bfloat16), n, v, logits.stride(0), ids.data_ptr(),
                      lps.data_ptr(), torch.get_num_threads())  # fmt: skip
        return None if rc else (ids, lps)


class NormKernel:
    """norm.cpp: RMSNorm of bfloat16 rows with Hugging Face's casts."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._fn = lib.pagemill_rms_norm_bf16
        self._fn.restype = None
        i64 = ctypes.c_int64
        self._fn.argtypes = [ctypes.c_void_p, i64, i64, i64, ctypes.c_void_p, ctypes.c_float, ctypes.c_void_p,
                             ctypes.c_int]  # fmt: skip
        self._add = lib.pagemill_add_rms_norm_bf16
        self._add.restype = None
        vp = ctypes.c_void_p
        self._add.argtypes = [vp, i64, vp, i64, i64, i64, vp, ctypes.c_float, vp, vp, ctypes.c_int]

    def applies(self, x: torch.Tensor, weight: torch.Tensor) -> bool:
        return (x.dtype == weight.dtype == torch.bfloat16 and x.device.type == "cpu" and x.dim() == 2
                and x.stride(1) == 1 and weight.is_contiguous() and x.shape[1] == weight.shape[0])  # fmt: skip

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """x [N, H] bf16 (unit stride in H), weight [H] bf16 -> [N, H] bf16."""
        out = torch.empty(x.shape, dtype=x.dtype)
        self._fn(x.data_ptr(), x.shape[0], x.shape[1], x.stride(0), weight.data_ptr(), eps, out.data_ptr(),
                 torch.get_num_threads())  # fmt: skip
        return out

    def add(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
            eps: float) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """(x + residual, its norm), both [N, H] bf16, new tensors: bit for bit torch's bf16 add and
        then __call__. x and residual as __call__'s x (applies() holds for both), of one shape."""
        rows, h = x.shape
        summed, out = torch.empty((2, rows, h), dtype=x.dtype).unbind(0)  # one allocation
        self._add(x.data_ptr(), x.stride(0), residual.data_ptr(), residual.stride(0), rows, h, weight.data_ptr(), eps,
                  summed.data_ptr(), out.data_ptr(), torch.get_num_threads())  # fmt: skip
        return summed, out


class ElementwiseKernels:
    """elementwise.cpp: SwiGLU's silu(gate) * up and rotary embedding of bfloat16 rows, with
    Hugging Face's bf16 roundings, one pass each."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        vp, i64 = ctypes.c_void_p, ctypes.c_int64
        self._silu_mul = lib.pagemill_silu_mul_bf16
        self._silu_mul.restype = None
        self._silu_mul.argtypes = [vp, i64, i64, i64, vp, ctypes.c_int]
        self._rotary = lib.pagemill_rotary_bf16
        self._rotary.restype = None
        self._rotary.argtypes = [vp, i64, i64, i64, i64, vp, vp, vp, ctypes.c_int]

    @staticmethod
    def applies(x: torch.Tensor) -> bool:
        return x.dtype == torch.bfloat16 and x.device.type == "cpu" and x.stride(-1) == 1

    def silu_mul(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, 2n] bf16 (gate then up, unit stride in the last dim) -> silu(gate) * up [N, n]."""
        rows, n = x.shape[0], x.shape[1] // 2
        out = torch.empty((rows, n), dtype=x.dtype)
        self._silu_mul(x.data_ptr(), rows, n, x.stride(0), out.data_ptr(), torch.get_num_threads())
        return out

    def rotary(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [T, heads, D] bf16 with heads D apart (any token stride), cos/sin [T, D] bf16 -> the
        rotated heads [T, heads, D], contiguous (layers.apply_rotary's arithmetic)."""
        t, heads, d = x.shape
        if x.stride(1) != d or cos.shape != (t, d) or sin.shape != (t, d):
            raise ValueError(f"rotary kernel: unexpected layout {tuple(x.stride())} / {tuple(cos.shape)}")
        cos, sin = cos.contiguous(), sin.contiguous()
        out = torch.empty((t, heads, d), dtype=x.dtype)
        self._rotary(x.data_ptr(), t, heads, d, x.stride(0), cos.data_ptr(), sin.data_ptr(), out.data_ptr(),
                     torch.get_num_threads())  # fmt: skip
        return out


def elementwise_kernels() -> ElementwiseKernels | None:
    """The process-wide element-wise kernels; None where unavailable."""
    lib = library()
    return None if lib is None else wrapper("elementwise", ElementwiseKernels, lib)


def norm_kernel() -> NormKernel | None:
    """The process-wide RMSNorm kernel; None where unavailable."""
    lib = library()
    return None if lib is None else wrapper("norm", NormKernel, lib)


def greedy_kernel() -> GreedyKernel | None:
    """The process-wide greedy kernel; None where unavailable."""
    lib = library()
    return None if lib is None else wrapper("greedy", GreedyKernel, lib)
