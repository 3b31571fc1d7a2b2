"""`--dtype auto` (the default): the fastest dtype this machine computes natively.

- CPU: bfloat16 where the CPU has AVX512-BF16 or AMX-BF16 (native bf16 dot
  products: the compiled kernels and oneDNN's GEMMs run bf16 at full speed
  and a decode step reads half the bytes); float32 elsewhere, where bf16
  would be emulated by widening and is no faster than float32 (docs/cpu.md).
- CUDA: bfloat16 where the GPU supports it, else float32.

The choice and why are returned for the startup log; the shard's Info (and
so the router's `/info` `model_dtype`) reports the resolved name. torch is
imported only for CUDA: the launcher resolves the dtype before any shard
starts and does not load torch itself.
"""

from __future__ import annotations

import platform
from pathlib import Path

# /proc/cpuinfo flags that mean native bf16 arithmetic.
BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")


def resolve_dtype(name: str, device) -> tuple[str, str]:
    """(dtype name, reason) for a device name or torch.device. Names other than "auto" pass
    through unchanged."""
    if name != "auto":
        return name, "asked for"
    if str(device).partition(":")[0] == "cuda":
        import torch

        if torch.cuda.is_available() and torch.cuda.is_bf16_supported():
            return "bfloat16", "auto: the GPU supports bfloat16"
        return "float32", "auto: no bfloat16 on this GPU"
    flags = cpu_flags()
    native = [f for f in BF16_CPU_FLAGS if f in flags]
    if native:
        return "bfloat16", f"auto: the CPU has {'/'.join(native)}"
    return "float32", f"auto: the CPU has none of {'/'.join(BF16_CPU_FLAGS)}"


def cpu_flags() -> set[str]:
    """The CPU's feature flags (Linux /proc/cpuinfo); empty where unreadable."""
    if platform.system() != "Linux":
        return set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.partition(":")[2].split())
    except OSError:
        pass
    return set()
