"""Binding of csrc/common/read_rate.cpp: the benchmarks' plain memory read."""

from __future__ import annotations

import ctypes
from collections.abc import Callable

import torch

from pagemill.cpu_kernels.build import library


def plain_read() -> Callable[[torch.Tensor], float] | None:
    """fn(t): every byte of a contiguous CPU float32 tensor read once by the torch thread count,
    64 bytes a load (read_rate.cpp; the benchmarks' floors); None where the library is unavailable."""
    lib = library()
    if lib is None:
        return None
    fn = lib.pagemill_read
    fn.restype = ctypes.c_float
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int]
    return lambda t: fn(t.data_ptr(), t.numel() * t.element_size(), torch.get_num_threads())
