"""Binding of csrc/quant/: linears, embedding lookups and dequantization straight from a GGUF's
quantized blocks (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K; F32/F16/BF16 rows through a
plain float path).

    kernel = quant_kernel()                       # None where the library is unavailable
    w = kernel.prepare(qweight, qtype, in_features)  # once, at load: the GGUF bytes [N, row_bytes]
    y = kernel.linear(x, w, bias)                 # x [M, K] float32 / bfloat16 -> [M, N]
    e = kernel.embedding(ids, w, torch.bfloat16)  # rows of W for token ids -> [T, K]

prepare repacks a quantized weight into csrc/quant/repack.h's layout (the same bytes, groups of
8 output rows interleaved) and returns the repacked tensor in place of the original; drop the
original afterwards. The activations are quantized per call as ggml quantizes them (blocks of
32 for the 32-element types, Q8_K's 256 for the K-quants), so the sums are llama.cpp's.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field

import torch

from pagemill.cpu_kernels.build import library, wrapper


@dataclass(frozen=True)
class QuantType:
    name: str
    block_elems: int  # elements per block (1 for the float types)
    block_bytes: int  # bytes per block


# ggml's type ids (ggml.h's enum ggml_type) for the types the kernels read.
GGML_TYPES: dict[int, QuantType] = {
    0: QuantType("F32", 1, 4),
    1: QuantType("F16", 1, 2),
    2: QuantType("Q4_0", 32, 18),
    3: QuantType("Q4_1", 32, 20),
    6: QuantType("Q5_0", 32, 22),
    7: QuantType("Q5_1", 32, 24),
    8: QuantType("Q8_0", 32, 34),
    12: QuantType("Q4_K", 256, 144),
    13: QuantType("Q5_K", 256, 176),
    14: QuantType("Q6_K", 256, 210),
    30: QuantType("BF16", 1, 2),
}
FLOAT_TYPES = frozenset({0, 1, 30})
_ROW_DTYPES = (torch.float32, torch.bfloat16)


def _type_name(qtype: int) -> str:
    t = GGML_TYPES.get(qtype)
    return t.name if t else f"ggml type {qtype}"


@dataclass(frozen=True, eq=False)
class PreparedWeight:
    """A weight as the kernels read it: `data` uint8 [out_features, row_bytes], the GGUF rows
    repacked (quantized types) or as they are (float types)."""

    data: torch.Tensor
    qtype: int
    out_features: int
    in_features: int
    data_ptr: int = field(init=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "data_ptr", self.data.data_ptr())

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    @property
    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.data,)

    @property
    def type_name(self) -> str:
        return _type_name(self.qtype)


class QuantKernel:
    """quant.cpp's entry points. Errors are ValueErrors that name the type and the shapes."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        vp, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
        self._supported = lib.pagemill_quant_supported
        self._supported.restype, self._supported.argtypes = i32, [i32]
        self._prepare = lib.pagemill_quant_prepare
        self._prepare.restype, self._prepare.argtypes = i32, [i32, vp, vp, i64, i64, i32]
        self._linear = lib.pagemill_quant_linear
        self._linear.restype = i32
        self._linear.argtypes = [i32, vp, i64, i64, vp, i32, i64, vp, vp, i32]
        self._rows = lib.pagemill_quant_rows
        self._rows.restype, self._rows.argtypes = i32, [i32, vp, i64, i64, vp, i64, vp, i32, i32]
        self._tail = lib.pagemill_quant_pack_tail
        self._tail.restype, self._tail.argtypes = i32, [i32, vp, i64, i64, vp]
        # 2: VNNI (vpdpbusd), 1: AVX2 (vpmaddubsw), 0: the portable loops.
        self.simd = int(lib.pagemill_quant_simd())

    def supports(self, qtype: int) -> bool:
        return qtype in GGML_TYPES and bool(self._supported(qtype))

    @staticmethod
    def row_bytes(qtype: int, in_features: int) -> int:
        """Bytes of one GGUF row of `in_features` elements; ValueError where they are not whole blocks."""
        t = GGML_TYPES.get(qtype)
        if t is None:
            raise ValueError(f"unsupported GGUF weight type {_type_name(qtype)}")
        if in_features <= 0 or in_features % t.block_elems:
            raise ValueError(f"{t.name}: in_features {in_features} is not a positive multiple of its "
                             f"{t.block_elems}-element blocks")  # fmt: skip
        return in_features // t.block_elems * t.block_bytes

    def prepare(self, qweight: torch.Tensor, qtype: int, in_features: int) -> PreparedWeight:
        """The GGUF bytes of a 2-d weight (uint8 [N, row_bytes], row n = output feature n) -> the
        weight the kernels read, made once at load (quantized types: a repacked tensor of the same
        size, returned in place of qweight)."""
        name, rb = _type_name(qtype), self.row_bytes(qtype, in_features)
        if not isinstance(qweight, torch.Tensor) or qweight.dtype != torch.uint8 or qweight.dim() != 2:
            raise ValueError(f"{name}: prepare takes a 2-d uint8 tensor of GGUF rows, got "
                             f"{getattr(qweight, 'dtype', type(qweight))} {tuple(getattr(qweight, 'shape', ()))}")  # fmt: skip
        if qweight.shape[1] != rb or qweight.shape[0] == 0 or qweight.device.type != "cpu":
            raise ValueError(f"{name}: {in_features} in_features take rows of {rb} bytes, got a "
                             f"{qweight.device.type} tensor of shape {tuple(qweight.shape)}")  # fmt: skip
        src = qweight.contiguous()
        n = src.shape[0]
        if qtype in FLOAT_TYPES:
            return PreparedWeight(src, qtype, n, in_features)
        dst = torch.empty_like(src)
        rc = self._prepare(qtype, src.data_ptr(), dst.data_ptr(), n, in_features, torch.get_num_threads())
        if rc != 0:
            raise ValueError(f"{name}: prepare rejected a weight of shape {tuple(src.shape)} ({in_features} in_features)")
        return PreparedWeight(dst, qtype, n, in_features)

    def linear(self, x: torch.Tensor, w: PreparedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [..., K] float32 or bfloat16 (CPU) -> x @ W^T (+ bias) [..., N] in x's dtype."""
        n, k = w.out_features, w.in_features
        # The decode path (2-d contiguous rows, no bias) checks only what it must: at one row of a
        # small weight the Python around the call costs as much as the call (x.device.type and
        # reshapes were most of it).
        if type(x) is not torch.Tensor or x.dtype not in _ROW_DTYPES or not x.is_cpu:
            raise ValueError(f"{w.type_name} linear takes float32/bfloat16 CPU rows, got "
                             f"{getattr(x, 'dtype', type(x))} {tuple(getattr(x, 'shape', ()))}")  # fmt: skip
        shape = x.shape
        if len(shape) == 0 or shape[-1] != k:
            raise ValueError(f"{w.type_name} linear: x {tuple(shape)} against a weight [{n}, {k}]")
        rows = x if len(shape) == 2 and x.is_contiguous() else x.reshape(-1, k).contiguous()
        b = 0
        if bias is not None:
            if not isinstance(bias, torch.Tensor) or bias.numel() != n or bias.dim() != 1:
                raise ValueError(f"{w.type_name} linear: bias {tuple(getattr(bias, 'shape', ()))} for {n} outputs")
            bias = bias.detach().to(torch.float32).contiguous()
            b = bias.data_ptr()
        m = rows.shape[0]
        y = torch.empty((m, n), dtype=x.dtype)
        rc = self._linear(w.qtype, w.data_ptr, n, k, rows.data_ptr(), int(x.dtype == torch.bfloat16), m, b,
                          y.data_ptr(), torch.get_num_threads())  # fmt: skip
        if rc != 0:
            raise ValueError(f"{w.type_name} linear rejected x {tuple(shape)} against [{n}, {k}]")
        return y if len(shape) == 2 else y.reshape(*shape[:-1], n)

    def tail(self, w: PreparedWeight) -> torch.Tensor | None:
        """The last out_features % 8 rows of a quantized weight as the group the kernels read
        (uint8 [8 * row_bytes]), which the fused decode layer (decode_gguf.cpp) takes made once;
        None where out_features is a multiple of 8."""
        if w.qtype in FLOAT_TYPES or w.out_features % 8 == 0:
            return None
        out = torch.empty(8 * self.row_bytes(w.qtype, w.in_features), dtype=torch.uint8)
        if self._tail(w.qtype, w.data_ptr, w.out_features, w.in_features, out.data_ptr()) != 0:
            raise ValueError(f"{w.type_name}: packing the tail of [{w.out_features}, {w.in_features}] failed")
        return out

    def embedding(self, ids: torch.Tensor, w: PreparedWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Rows `ids` (int64 [T], any shape) of W as floats -> [*ids.shape, K] in dtype (float32 / bfloat16)."""
        if not isinstance(ids, torch.Tensor) or ids.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"{w.type_name} embedding takes int64 ids, got {getattr(ids, 'dtype', type(ids))}")
        if dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"{w.type_name} embedding writes float32 or bfloat16, not {dtype}")
        flat = ids.reshape(-1).to(torch.int64).contiguous()
        return self._read_rows(w, flat, dtype).reshape(*ids.shape, w.in_features)

    def dequantize(self, w: PreparedWeight) -> torch.Tensor:
        """The whole weight as float32 [N, K] (tests, fallbacks)."""
        return self._read_rows(w, None, torch.float32)

    def _read_rows(self, w: PreparedWeight, ids: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
        t = w.out_features if ids is None else ids.numel()
        y = torch.empty((t, w.in_features), dtype=dtype)
        rc = self._rows(w.qtype, w.data_ptr, w.out_features, w.in_features, None if ids is None else ids.data_ptr(),
                        t, y.data_ptr(), int(dtype == torch.bfloat16), torch.get_num_threads())  # fmt: skip
        if rc == 2:
            bad = ids[(ids < 0) | (ids >= w.out_features)][:4].tolist() if ids is not None else []
            raise ValueError(f"{w.type_name} embedding: ids {bad} outside [0, {w.out_features})")
        if rc != 0:
            raise ValueError(f"{w.type_name}: reading rows of [{w.out_features}, {w.in_features}] failed")
        return y


def quant_kernel() -> QuantKernel | None:
    """The process-wide quant kernels, built or loaded on first call; None where unavailable."""
    lib = library()
    return None if lib is None else wrapper("quant", QuantKernel, lib)
