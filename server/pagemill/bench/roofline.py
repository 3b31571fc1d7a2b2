"""A roofline for decode on this machine: what one step cannot beat.

One decode step must read every weight once (the projections and the output
head; the embedding lookup reads B rows only) plus the KV cache of every
sequence, and must do 2 FLOPs per weight per token plus attention. So

    floor(B, ctx) = max(bytes(B, ctx) / bandwidth, flops(B, ctx) / matmul rate)

bandwidth: the better of a large tensor copy (read + write counted) and a
large read (the faster of torch's sum and a compiled loop of plain loads,
cpu_kernels/csrc/common/read_rate.cpp, where it builds), both far beyond the last-level
cache and in huge pages where the OS grants them, as a shard's weights and
KV pool are (models/huge_pages.py). On the 2-vCPU Xeon of docs/benchmarks.md
a 512 MiB sum read 22.8 GB/s from 4 KiB pages and 30.1 from huge pages, the
compiled loop 26.1 and 30.9; once the decode linears asked for their weights
ahead of use (cpu_kernels/csrc/common/vec.h), a batch-1 step read its weights faster
than the 4 KiB sum's rate, so that floor was no floor. matmul rate: a
large float32 torch.mm (and the same in bfloat16 for bf16 floors). Both with
the torch thread count in force.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import torch

from pagemill.cpu_kernels.read_rate import plain_read
from pagemill.models.config import ModelConfig
from pagemill.models.huge_pages import huge_zeros


@dataclass
class Machine:
    threads: int
    copy_gbs: float
    sum_gbs: float  # the read rate: torch's sum or the compiled read, whichever was faster
    bandwidth_gbs: float  # the one the roofline uses: max(copy, sum)
    matmul_gflops: float
    matmul_bf16_gflops: float | None = None  # the same product in bfloat16 (oneDNN's bf16 GEMM)


@dataclass
class Floor:
    batch_size: int
    context: int
    weight_bytes: int
    kv_bytes: int
    flops: float
    memory_ms: float
    compute_ms: float
    floor_ms: float
    binds: str  # "memory" or "compute"


def _best_of(fn, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def read_buffer(mib: int) -> torch.Tensor:
    """A float32 buffer of `mib` MiB in huge pages where the OS grants them (as the weights are)."""
    return huge_zeros((mib * (1 << 20) // 4,), torch.float32).normal_()


def readers(a: torch.Tensor) -> list:
    """The ways the read rate of `a` is taken (the fastest counts): torch's sum, and the compiled
    plain read where the kernels build."""
    read = plain_read()
    return [a.sum] + ([lambda: read(a)] if read is not None else [])


def measure_machine(buffer_mib: int = 512, mm_size: int = 2048, repeats: int = 5) -> Machine:
    a = read_buffer(buffer_mib)
    b = huge_zeros(tuple(a.shape), torch.float32)
    copy = 2 * a.numel() * 4 / _best_of(lambda: b.copy_(a), repeats) / 1e9
    summ = max(a.numel() * 4 / _best_of(fn, repeats) / 1e9 for fn in readers(a))
    del a, b
    mm = gemm_gflops(torch.float32, mm_size, repeats)[0]
    mm_bf16 = gemm_gflops(torch.bfloat16, mm_size, repeats)[0]
    return Machine(torch.get_num_threads(), copy, summ, max(copy, summ), mm, mm_bf16)


def gemm_gflops(dtype: torch.dtype, size: int, repeats: int, budget_s: float = 2.0) -> tuple[float, int]:
    """GFLOP/s of a square `dtype` matmul and the size measured: `size`, or smaller where one
    product would take over `budget_s` (bfloat16 on a CPU without AVX512-BF16 or AMX runs some
    hundred times under float32's rate: a 2048 product took over a minute on a Zen 3)."""
    probe = torch.randn(256, 256).to(dtype)
    rate = 2 * 256**3 / _best_of(lambda: torch.mm(probe, probe), 1)
    n = size
    if 2 * n**3 / rate > budget_s:
        n = max(256, min(size, int((budget_s * rate / 2) ** (1 / 3)) // 64 * 64))
    x = torch.randn(n, n).to(dtype)
    return 2 * n**3 / _best_of(lambda: torch.mm(x, x), repeats) / 1e9, n


def decode_floor(cfg: ModelConfig, m: Machine, batch_size: int, context: int, dtype_bytes: int = 4) -> Floor:
    h, i, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q, kv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    per_layer = h * (q + 2 * kv) + q * h + 3 * h * i  # qkv, o, gate/up/down
    matmul_params = cfg.num_hidden_layers * per_layer + cfg.vocab_size * h  # + output head
    weight_bytes = matmul_params * dtype_bytes + 2 * cfg.num_hidden_layers * h * dtype_bytes  # + norms
    kv_bytes = batch_size * context * 2 * cfg.num_hidden_layers * kv * dtype_bytes
    attn_flops = 4 * batch_size * context * cfg.num_attention_heads * d * cfg.num_hidden_layers
    flops = 2.0 * matmul_params * batch_size + attn_flops
    mem_ms = (weight_bytes + kv_bytes) / (m.bandwidth_gbs * 1e9) * 1e3
    comp_ms = flops / (m.matmul_gflops * 1e9) * 1e3
    return Floor(batch_size, context, weight_bytes, kv_bytes, flops, mem_ms, comp_ms, max(mem_ms, comp_ms),
                 "memory" if mem_ms >= comp_ms else "compute")  # fmt: skip


def roofline_report(cfg: ModelConfig, batch_sizes=(1, 8, 64), context: int = 128) -> dict:
    m = measure_machine()
    return {"machine": asdict(m), "floors": [asdict(decode_floor(cfg, m, b, context)) for b in batch_sizes]}
