"""nn.Linear with an optional oneDNN-packed copy of its weight for CPU decode.

Why: on this kind of CPU (AMD EPYC, AVX-512), torch's float32 `F.linear`
goes through MKL, whose matrix-vector path reaches ~9 GB/s, a third of the
memory bandwidth; decode at small batch is exactly that matrix-vector
product. oneDNN's inner product over a weight reordered once into its
blocked layout reads the weight about twice as fast (1..64 rows) and is also
faster at batch 64. Large prefills keep MKL's GEMM (plain weight), which is
compute-bound and as fast or faster there.

The packed copy costs the weight's memory a second time; it is only made on
CPU for float32 and, where oneDNN runs bf16 natively, bfloat16 (oneDNN's
brg_matmul:avx512_core_bf16 either way; see docs/cpu.md for whether the
packed bf16 copy pays).

At MATVEC_MAX_ROWS (1) row a compiled matrix-vector kernel
(pagemill.cpu_kernels) beats both: it reads the plain weight at close to
memory speed.

bfloat16 on a CPU with AVX512-BF16: a compiled GEMM (cpu_kernels/csrc/gemm/gemm_bf16.h)
over its own packed copy replaces oneDNN's at every row count from 2, in place
of the oneDNN copy (the memory is the same). In a decode step it streams the
weights at close to memory speed where oneDNN's did not, and multiplies at the
core's vdpbf16ps rate (docs/cpu.md has the figures). With AMX-BF16 it
multiplies on AMX tiles from 4 rows (gemm_amx.h): measured 1.3-1.9x oneDNN's
AMX kernels at 4-64 rows, 0.73-0.97x at 2048-row prefills, and it keeps
the batched decode layer and the SwiGLU epilogue, which oneDNN's would not.
A kernel built without the tiles on an AMX CPU leaves oneDNN in charge.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# Rows (tokens) up to which oneDNN's packed weight is used. Measured on the
# default model: oneDNN wins clearly up to a few hundred rows, MKL's GEMM
# catches up around 512 (prefill).
PACKED_MAX_ROWS = 256
# oneDNN picks its blocking from a batch-size hint; 16 gave the best
# bandwidth at 1..16 rows and matched hint=64 at 64 rows.
_PACK_HINT = 16
# Rows up to which the compiled matvec kernel is used instead. Measured on
# the default model, 2 threads, idle machine, interleaved A/B
# (benchmarks/decode_ab.py): batch-1 decode step 42-44 -> 29-31 ms (1.4x);
# batch 2 1.01x (no gain), so only single rows take it.
MATVEC_MAX_ROWS = 1
# Whether bfloat16 weights get a packed copy too. Measured (benchmarks/bf16_ab.py,
# 1 thread; docs/cpu.md): the decode linears at 64 rows 155.6 ms packed vs 192.7 ms
# F.linear, a batch-64 decode step 224 vs 260 ms; so yes, for 269 MB on the default model.
PACK_BF16 = True


def bf16_linear_path(flags: set[str], kernel_fast: bool, asked: str = "auto", kernel_amx: bool = False) -> str:
    """Which multiplies a packed bf16 linear: "kernel" (gemm_bf16) or "onednn". asked: "auto"
    (the measured choice), or either name (benchmarks compare them; an unbuilt kernel -> onednn).
    kernel_amx: the kernel runs on AMX tiles (gemm_amx.h), so it is kept on AMX CPUs too."""
    if asked not in ("auto", "kernel", "onednn"):
        raise ValueError(f"bf16 linear path must be auto, kernel or onednn, got {asked!r}")
    if not kernel_fast:
        return "onednn"
    if asked != "auto":
        return asked
    return "onednn" if "amx_bf16" in flags and not kernel_amx else "kernel"


def packing_available(device: torch.device, dtype: torch.dtype) -> bool:
    if dtype == torch.bfloat16:
        if not _mkldnn_bf16():
            return False
    elif dtype != torch.float32:
        return False
    return (
        device.type == "cpu"
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )


def _mkldnn_bf16() -> bool:
    """Whether oneDNN has native bf16 kernels on this CPU (AVX512-BF16 or AMX), not emulation."""
    check = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return bool(check is not None and check())


class PackedLinear(nn.Linear):
    """Same parameters and state-dict names as nn.Linear; `pack()` after loading."""

    packed: torch.Tensor | None = None  # oneDNN's copy, or gemm_bf16's where self.gemm is set
    matvec = None  # cpu_kernels.MatvecKernel, set by pack() where it builds
    gemm = None  # cpu_kernels.gemm.GemmBf16Kernel, set by pack() for bf16 where it pays
    invariant = None  # --batch-invariant: models/batch_invariant.py's Invariant, which runs every product
    lora = None  # lora.apply.LoraLayer: adapters' low-rank products added to the output (lora/layers.py)

    def pack(self, cpu_kernels: bool = True, bf16_linear: str = "auto") -> None:
        """(Re)builds the packed copy from the current weight; no-op where unsupported.
        cpu_kernels: also use the compiled matvec for single rows and, for bf16, the compiled
        GEMM for more (cpu_kernels/); bf16_linear: bf16_linear_path's `asked`."""
        w = self.weight
        self.packed = self.matvec = self.gemm = None
        if not packing_available(w.device, w.dtype):
            return
        if cpu_kernels and w.dtype == torch.bfloat16 and w.dim() == 2:
            from pagemill.cpu_kernels.gemm import gemm_bf16_kernel, pack_bf16
            from pagemill.models.auto_dtype import cpu_flags

            kernel = gemm_bf16_kernel()
            fast, amx = kernel is not None and kernel.fast, kernel is not None and kernel.amx
            if bf16_linear_path(cpu_flags(), fast, bf16_linear, amx) == "kernel":
                self.gemm, self.packed = kernel, pack_bf16(w)
        if self.gemm is None and (w.dtype == torch.float32 or PACK_BF16):
            self.packed = torch.ops.mkldnn._reorder_linear_weight(w.detach(), _PACK_HINT)
        if cpu_kernels and w.is_contiguous():
            from pagemill.cpu_kernels.matvec import matvec_kernel

            self.matvec = matvec_kernel()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.matmul(x, self.bias)
        return out if self.lora is None else self.lora(x, out)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x @ weight.T (+ bias), through the matvec kernel or the packed weight where they pay."""
        rows = x.shape[0] if x.dim() == 2 else 0
        if x.dtype != self.weight.dtype or rows == 0 or (torch.is_grad_enabled() and x.requires_grad):
            return F.linear(x, self.weight, bias)  # the packed ops have no backward
        if self.invariant is not None:
            return self.invariant.linear(x, self.weight, bias)
        if self.matvec is not None and rows <= MATVEC_MAX_ROWS:
            return self.matvec(x.contiguous(), self.weight, bias)
        if self.gemm is not None and (bias is None or bias.dtype == x.dtype):
            # At any row count: measured as fast as MKL's GEMM at 300-2048 rows (docs/cpu.md).
            rows_ok = x.stride(1) == 1 and x.stride(0) >= x.shape[1]  # else rows overlap (an expanded x)
            return self.gemm(x if rows_ok else x.contiguous(), self.packed, bias, self.out_features)
        if rows > PACKED_MAX_ROWS:
            return F.linear(x, self.weight, bias)
        if self.packed is not None and self.gemm is None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, bias, "none", [], "")
        return F.linear(x, self.weight, bias)


def pack_all(module: nn.Module, cpu_kernels: bool = True, bf16_linear: str = "auto") -> int:
    """Packs every PackedLinear under `module`; returns how many were packed."""
    n = 0
    for m in module.modules():
        if isinstance(m, PackedLinear):
            m.pack(cpu_kernels, bf16_linear)
            n += m.packed is not None
    return n
