"""The floors a `pagemill bench compare` run is measured against: what no server
at a given precision can beat on this machine, from the bandwidth and GEMM
rate measured before each run (bench/roofline.py, bench/workload_floor.py)."""

from __future__ import annotations

from dataclasses import replace

from pagemill.bench.compare_report import WEIGHT_BYTES
from pagemill.bench.roofline import Machine, decode_floor
from pagemill.bench.workload_floor import continuous_floor
from pagemill.models.config import ModelConfig


def read_bandwidth(machine: Machine) -> Machine:
    """The machine with its read rate (the large sum) as the roofline's bandwidth. A decode step
    only reads weights and KV; the copy's rate counts a write per read and, with the line
    read for it, came out up to 1.7x the sum's on the reference machine: a floor no reader meets."""
    return replace(machine, bandwidth_gbs=machine.sum_gbs)


def batch1_floor_ms(model_cfg: ModelConfig, machine: Machine, precision: str, context: int) -> float | None:
    """Time to read every weight (and the context's KV) once at the machine's read bandwidth: what
    one batch-1 decode step at `precision` cannot beat. None for a precision without a known size."""
    nbytes = WEIGHT_BYTES.get(precision.lower())
    return None if nbytes is None else decode_floor(model_cfg, read_bandwidth(machine), 1, context, nbytes).memory_ms


def workload_ceiling(model_cfg: ModelConfig, machine: Machine, precision: str, requests) -> float | None:
    """Output tok/s of the c=N workload if every step ran at this machine's roofline (weights and
    KV read once per step at its bandwidth, every matmul at its measured GEMM rate in that
    precision; bench/workload_floor.py). bf16 and fp32 only: other precisions' GEMM rates are
    not measured."""
    p = precision.lower()
    rate = machine.matmul_bf16_gflops if p in ("bf16", "bfloat16") else machine.matmul_gflops if p in (
        "fp32", "float32") else None  # fmt: skip
    if not rate:
        return None
    m = replace(read_bandwidth(machine), matmul_gflops=rate)
    floor = continuous_floor(model_cfg, m, [r.prompt_len for r in requests], [r.output_len for r in requests],
                             WEIGHT_BYTES[p])  # fmt: skip
    return floor.throughput_ceiling
