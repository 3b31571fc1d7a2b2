"""Typed configuration passed explicitly from the CLI to each component."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ShardConfig:
    model_dir: str  # Hugging Face layout: config.json + *.safetensors (+ tokenizer files)
    uds_path: str  # unix socket this shard serves gRPC on
    rank: int = 0
    world_size: int = 1
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    local_rank: int | None = None  # GPU index on this node (default: rank % visible GPUs)
    dist_timeout_s: float = 300.0  # how long a collective waits for a lost peer before failing
    dtype: str = "auto"  # auto (models/auto_dtype.py) | float32 | bfloat16 | float16
    device: str = "cpu"  # cpu | cuda
    block_size: int = 16
    # Bytes of KV pool on CPU (all layers, K and V). On CUDA the pool is sized
    # from free memory times gpu_memory_utilization instead.
    kv_cache_memory: int = 1 << 30
    gpu_memory_utilization: float = 0.9
    attention: str = "auto"  # auto | flash | triton | torch
    num_threads: int = 0  # torch intra-op threads; 0 keeps torch's default
    speculate: int = 0  # proposals verified per decode step (0: no speculation)
    speculate_method: str = "ngram"  # ngram (prompt lookup) | draft (a second, smaller model)
    draft_model: str | None = None  # HF model dir of the draft (same tokenizer as the target)
    # Decode steps replay CUDA graphs captured at warmup (shard/cuda_graphs.py); ignored on CPU
    # and with speculate > 0.
    cuda_graphs: bool = True
    # Compiled float32/bfloat16 CPU decode kernels (cpu_kernels/, docs/cpu.md).
    cpu_kernels: bool = True
    # None, or "int8": int8 linears on the CPU (models/quantized_linear.py, docs/quantization.md).
    quantize: str | None = None
    kv_cache_dtype: str = "auto"  # auto (the model dtype) | fp8_e4m3 | fp8_e5m2 (attention/kv_dtype.py)


QUANTIZE_METHODS = ("int8",)


def check_quantize(method: str | None, device_type: str, world_size: int) -> None:
    """Raises ValueError where `--quantize method` cannot run; None (no quantization) always can.
    Here, without torch, so that the launcher rejects a bad combination before starting shards."""
    if method is None:
        return
    if method not in QUANTIZE_METHODS:
        raise ValueError(f"unknown quantization {method!r}; choose one of {', '.join(QUANTIZE_METHODS)}")
    if device_type != "cpu":
        raise ValueError(f"--quantize {method} runs on the CPU only (got --device {device_type})")
    if world_size != 1:
        raise ValueError(f"--quantize {method} does not support tensor parallelism (got {world_size} shards)")
