"""Typed configuration passed explicitly from the CLI to each component.

ShardConfig is the one declaration of the shard's options: `pagemill shard`
and `pagemill launch` generate their flags from its fields (options.py), and
the launcher forwards a ShardConfig to each shard as flags generated from it."""

from __future__ import annotations

from dataclasses import dataclass

from pagemill.options import option, parse_bytes

QUANTIZE_METHODS = ("int8",)
MODEL_IMPLS = ("auto", "native", "transformers")  # models/impl.py
KV_CACHE_DTYPES = ("auto", "fp8_e4m3", "fp8_e5m2", "int8")  # attention/kv_dtype.py


@dataclass(frozen=True)
class ShardConfig:
    # Per process: `pagemill launch` sets these for each shard it starts. The defaults of the
    # distributed ones come from torch.distributed's usual environment under `pagemill shard`, so
    # that a multi-node launcher (torchrun-style, SLURM wrappers) can start it unchanged
    # (docs/parallelism.md).
    model_dir: str = option(per_process=True,
                            help="Hugging Face model dir: config.json + *.safetensors (+ tokenizer files)")
    uds_path: str = option("", per_process=True, help="unix socket this shard serves gRPC on")
    # shard/auth.py, docs/parallelism.md: a shard group on another host than its router.
    listen: str | None = option(None, per_process=True,
                                help="host:port to serve gRPC on over TCP instead of a unix socket (a router on "
                                     "another host: pagemill router --shard-group); needs --shard-auth-token-file")
    shard_auth_token_file: str | None = option(None, per_process=True,
                                               help="file whose first line is the token every call must carry "
                                                    "(the router's --shard-auth-token-file); calls without it are "
                                                    "refused with UNAUTHENTICATED")
    rank: int = option(0, per_process=True, env="RANK", help="rank of this shard in its tensor-parallel group")
    world_size: int = option(1, per_process=True, env="WORLD_SIZE", help="shards in the tensor-parallel group")
    master_addr: str = option("127.0.0.1", per_process=True, env="MASTER_ADDR",
                              help="host of the torch.distributed rendezvous (rank 0)")
    master_port: int = option(29500, env="MASTER_PORT",
                              help="TCP port of the shards' torch.distributed rendezvous (more than one shard)")
    local_rank: int | None = option(None, per_process=True, env="LOCAL_RANK",
                                    help="GPU index of this shard on its node (default: rank % visible GPUs)")
    dist_timeout_s: float = option(300.0, flag="dist-timeout",
                                   help="seconds a collective waits for a lost peer shard before the call fails")
    dtype: str = option("auto", choices=("auto", "float32", "bfloat16", "float16"),
                        help="auto: bfloat16 on a CPU with AVX512-BF16 or AMX-BF16 (or a GPU with bf16), else "
                             "float32 (models/auto_dtype.py)")
    device: str = option("cpu", help="cpu or cuda")
    # shard/kv_pool.py's resolve_block_size: why the CPU takes larger blocks.
    block_size: int = option(0, help="tokens per KV block; 0 (auto): 64 on CPU, 16 on CUDA")
    # On CUDA the pool is sized from free memory times gpu_memory_utilization instead.
    kv_cache_memory: int = option(1 << 30, parse=parse_bytes,
                                  help="bytes of KV pool on CPU (all layers, K and V), e.g. 1GiB, 512MiB")
    gpu_memory_utilization: float = option(0.9, help="share of the GPU's free memory the shard may use (CUDA)")
    attention: str = option("auto", choices=("auto", "flash", "triton", "torch"), help="attention backend")
    num_threads: int = option(0, help="torch threads per shard (0: torch default)")
    # shard/cpu_pinning.py, docs/cpu.md
    cpu_bind: str = option("auto", help="cores a CPU shard's threads are pinned to, one OpenMP thread per core: "
                                        "auto (the first --num-threads cores this process may use; `launch` gives "
                                        "several shards disjoint ones), none, or a list such as 0-3,8")
    # shard/threads.py, docs/cpu.md
    adaptive_threads: bool = option(True, help="run small fused CPU decode steps with all threads or one, "
                                               "whichever measures faster (shared cores stall OpenMP barriers)")
    speculate: int = option(0, help="speculative tokens proposed and verified per decode step (0: off)")
    speculate_method: str = option("ngram", choices=("ngram", "draft"),
                                   help="ngram: prompt lookup, no second model; draft: a smaller model (--draft-model)")
    draft_model: str | None = option(None, help="HF model dir of the draft model (same tokenizer as the target)")
    # Decode steps replay CUDA graphs captured at warmup (shard/cuda_graphs.py).
    cuda_graphs: bool = option(True, help="replay decode steps from CUDA graphs captured at warmup "
                                          "(CUDA only; not with --speculate)")
    # cpu_kernels/, docs/cpu.md
    cpu_kernels: bool = option(True, help="compiled float32/bfloat16 CPU decode kernels: whole-layer decode up to 5 "
                                          "(bf16: 8) sequences, single-row matvec, in-place paged attention (needs a "
                                          "C++ compiler; docs/cpu.md)")
    # models/batch_invariant.py, attention/invariant_backend.py, docs/decoding.md
    batch_invariant: bool = option(False, help="a request's tokens and logprobs do not depend on what else shares "
                                               "its steps (fixed-shape linears and attention, no fused decode "
                                               "layers): N servers or data-parallel groups answer a request alike; "
                                               "CPU, native models, float or fp8 KV cache; costs throughput")
    # models/huge_pages.py, docs/cpu.md
    huge_pages: bool = option(True, help="CPU weights and KV pool in transparent huge pages (2 MiB) where the OS "
                                         "allows it: fewer TLB misses when a decode step streams the weights")
    # models/quantized_linear.py
    quantize: str | None = option(None, choices=QUANTIZE_METHODS,
                                  help="int8: int8 weights per output channel and int8 activations per token for "
                                       "every linear, output head included (CPU, one shard; docs/quantization.md)")
    # attention/kv_dtype.py
    # models/impl.py, docs/models.md
    model_impl: str = option("auto", choices=MODEL_IMPLS,
                             help="native: pagemill's own model code; transformers: transformers' modeling code "
                                  "over pagemill's paged attention (any causal LM it has); auto: native where it "
                                  "exists")
    kv_cache_dtype: str = option("auto", choices=KV_CACHE_DTYPES,
                                 help="KV cache storage: auto (the model dtype), fp8, which holds twice the tokens "
                                      "of bf16, or int8 with a scale per token and head (1.88x at head_dim 64; "
                                      "torch attention backend; docs/kv_cache.md)")
    # shard/kv_tier.py, docs/kv_cache.md: a second KV tier under the pool.
    kv_offload_dir: str | None = option(None, help="directory of the disk KV tier: prefix blocks are written there "
                                                   "and loaded back instead of recomputed, also after a restart")
    kv_offload_disk: int = option(8 << 30, parse=parse_bytes,
                                  help="byte budget of --kv-offload-dir (least recently used blocks are deleted)")
    kv_offload_memory: int = option(0, parse=parse_bytes,
                                    help="bytes of host memory for a KV tier without --kv-offload-dir (meant "
                                         "for a GPU pool; 0: none)")


def check_batch_invariant(cfg: "ShardConfig") -> None:
    """Raises ValueError where --batch-invariant cannot hold with the other options: the paths it
    fixes are the CPU's native model code, so it refuses what would go around them."""
    if not cfg.batch_invariant:
        return
    clash = [what for what, on in (("--device cuda", cfg.device != "cpu"), ("--quantize", cfg.quantize is not None),
                                    ("--model-impl transformers", cfg.model_impl == "transformers"),
                                    ("--kv-cache-dtype int8", cfg.kv_cache_dtype == "int8"),
                                    ("--speculate", cfg.speculate > 0))
             if on]  # fmt: skip
    if clash:
        raise ValueError(f"--batch-invariant does not combine with {', '.join(clash)}")


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
