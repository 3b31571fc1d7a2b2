"""Linears and the embedding that keep a GGUF file's weights in their blocks.

GGUFLinear holds the exact bytes of a 2-D weight (uint8 [N, row_bytes], row n = output
feature n) with its ggml type. `pack_weights` hands them once to the compiled int8 kernels
(cpu_kernels/quant.py: QuantKernel.prepare repacks the blocks into a copy of the same size,
which replaces the file's rows) where those are built and take the type; forward then runs
there (QuantKernel.linear: the activations quantized per call as ggml does, int8 dot products
over the blocks, the bias added in float32). Otherwise forward is the torch reference: dequantize
(dequant.py, bit-identical to gguf-py) in chunks of rows, then F.linear in the activation
dtype, so no float copy of the weight outlives a call (on a GPU too: per call).

GGUFConcatLinear stacks GGUFLinears whose outputs are concatenated (q|k|v, gate|up) where the
parts have different types, as in Q4_K_M files. GGUFEmbedding looks rows up in a GGUFLinear's
blocks and dequantizes only those; a tied output head is that same GGUFLinear.
"""

from __future__ import annotations

import ctypes
import logging
import mmap

import torch
import torch.nn.functional as F
from torch import nn

from pagemill.models.gguf.dequant import dequantize
from pagemill.models.gguf.types import ALL_TYPES

log = logging.getLogger(__name__)

# Values the torch path dequantizes at once (4 MiB of float32): bounds its temporary memory
# on a large matrix (a 262144-row output head) at no cost to small ones.
CHUNK_VALUES = 1 << 20
_MADV_DONTNEED = 4


def quant_kernel():
    """The compiled GGUF kernels (pagemill.cpu_kernels.quant), or None where absent or unbuilt."""
    try:
        from pagemill.cpu_kernels.quant import quant_kernel as get
    except ImportError:
        return None
    try:
        return get()
    except (OSError, RuntimeError) as e:  # a build failure: the torch path computes the same
        log.warning("GGUF kernels unavailable (%s): torch reference path", e)
        return None


def reference_linear(x: torch.Tensor, q: torch.Tensor, qtype: int, bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] @ dequantize(q).T (+ bias) in x's dtype, q dequantized CHUNK_VALUES at a time."""
    step = max(1, CHUNK_VALUES // x.shape[1])
    if q.shape[0] <= step:
        return F.linear(x, dequantize(q, qtype).to(x.dtype), bias)
    y = torch.cat([F.linear(x, dequantize(q[i : i + step], qtype).to(x.dtype)) for i in range(0, q.shape[0], step)], -1)
    return y if bias is None else y + bias


def _release_pages(t: torch.Tensor) -> None:
    """Drops the whole pages of a file-mapped tensor from this process (they stay in the page
    cache; the mapping is private and they were never written, so nothing is lost)."""
    page = mmap.PAGESIZE
    start, end = -(-t.data_ptr() // page) * page, (t.data_ptr() + t.numel()) // page * page
    if end > start:
        ctypes.CDLL(None).madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), _MADV_DONTNEED)


def _holds_own_copy(prepared: object, q: torch.Tensor) -> bool:
    """Whether the kernel's prepared weight keeps its blocks in a tensor of its own (so q is unused)."""
    base = q.untyped_storage().data_ptr()
    tensors = getattr(prepared, "tensors", None)
    if tensors is None:
        tensors = [v for v in vars(prepared).values() if isinstance(v, torch.Tensor)] \
            if hasattr(prepared, "__dict__") else []  # fmt: skip
    own = [t for t in tensors if t.untyped_storage().data_ptr() != base and t.nbytes >= q.nbytes * 9 // 10]
    return bool(own) and not any(t.untyped_storage().data_ptr() == base for t in tensors)


class GGUFLinear(nn.Module):
    def __init__(self, qweight: torch.Tensor, qtype: int, in_features: int, bias: torch.Tensor | None = None,
                 mapped: bool = False) -> None:  # fmt: skip
        """qweight: uint8 [N, row_bytes]; bias: [N] in the model dtype; mapped: qweight is a view
        of the file's mapping (its pages can be dropped once the kernel holds its own copy)."""
        super().__init__()
        t = ALL_TYPES[qtype]
        if qweight.dtype != torch.uint8 or qweight.dim() != 2 or qweight.shape[1] != t.row_bytes(in_features):
            raise ValueError(f"{t.name} weight of {in_features} inputs needs uint8 [N, {t.row_bytes(in_features)}], "
                             f"got {qweight.dtype} {list(qweight.shape)}")  # fmt: skip
        self.qtype, self.in_features, self.out_features = qtype, in_features, qweight.shape[0]
        self.register_buffer("qweight", qweight, persistent=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.mapped = mapped
        self.kernel = self.prepared = self.kernel_bias = None

    @property
    def type_name(self) -> str:
        return ALL_TYPES[self.qtype].name

    def pack_weights(self, cpu_kernels: bool = True) -> bool:
        """Prepares the kernel's weight (once); True where forward runs on the kernel."""
        if self.prepared is not None:
            return True
        if not cpu_kernels or self.qweight.device.type != "cpu":
            return False
        kernel = quant_kernel()
        if kernel is None or not kernel.supports(self.qtype):
            return False
        self.prepared = kernel.prepare(self.qweight, self.qtype, self.in_features)
        self.kernel = kernel
        if self.bias is not None:  # what the kernel adds, converted once rather than per call
            self.kernel_bias = self.bias.detach().to(torch.float32).contiguous()
        if _holds_own_copy(self.prepared, self.qweight):  # a repacked copy replaces the original
            if self.mapped:
                _release_pages(self.qweight)
            self.qweight = torch.empty(0, dtype=torch.uint8)
        return True

    def dequantize(self) -> torch.Tensor:
        """The weight as float32 [N, K]."""
        if self.qweight.numel() == 0 and self.prepared is not None:
            return self.kernel.dequantize(self.prepared)
        return dequantize(self.qweight, self.qtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead, dtype = x.shape[:-1], x.dtype
        rows = x.reshape(-1, self.in_features)
        if self.prepared is not None and rows.device.type == "cpu":
            if rows.dtype not in (torch.float32, torch.bfloat16):
                rows = rows.float()
            y = self.kernel.linear(rows.contiguous(), self.prepared, self.kernel_bias)
        else:
            y = reference_linear(rows, self.qweight, self.qtype, self.bias)
        return y.to(dtype).reshape(*lead, self.out_features)

    @property
    def on_kernel(self) -> bool:
        """Whether forward runs on the compiled kernels (else the torch reference)."""
        return self.prepared is not None

    def extra_repr(self) -> str:
        path = "kernel" if self.prepared is not None else "torch reference"
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.type_name}, {path}"


class GGUFConcatLinear(nn.Module):
    """Parts [N_i, K] of one projection whose outputs are concatenated (different ggml types)."""

    def __init__(self, parts: list[GGUFLinear]) -> None:
        super().__init__()
        if len({p.in_features for p in parts}) != 1:
            raise ValueError("concatenated GGUF linears must share in_features")
        self.parts = nn.ModuleList(parts)
        self.in_features = parts[0].in_features
        self.out_features = sum(p.out_features for p in parts)

    def dequantize(self) -> torch.Tensor:
        return torch.cat([p.dequantize() for p in self.parts])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([p(x) for p in self.parts], dim=-1)


class GGUFEmbedding(nn.Module):
    """Token embedding over a GGUFLinear's rows (vocab x hidden), dequantized at lookup."""

    def __init__(self, table: GGUFLinear, dtype: torch.dtype) -> None:
        super().__init__()
        self.table, self.dtype = table, dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        t, flat = self.table, ids.reshape(-1)
        if t.prepared is not None and flat.device.type == "cpu":
            out = self.dtype if self.dtype in (torch.float32, torch.bfloat16) else torch.float32
            rows = t.kernel.embedding(flat.to(torch.int64), t.prepared, out)
        else:
            rows = dequantize(t.qweight.index_select(0, flat), t.qtype)
        return rows.to(self.dtype).reshape(*ids.shape, t.in_features)


def gguf_linears(model: nn.Module) -> list[GGUFLinear]:
    return [m for m in model.modules() if isinstance(m, GGUFLinear)]


def holds_gguf_weights(model: nn.Module) -> bool:
    return any(isinstance(m, GGUFLinear) for m in model.modules())


def pack_gguf(model: nn.Module, cpu_kernels: bool = True) -> int:
    """pack_weights on every GGUFLinear (each once: a tied head is the embedding's table);
    returns how many run on the kernel."""
    return sum(m.pack_weights(cpu_kernels) for m in gguf_linears(model))
