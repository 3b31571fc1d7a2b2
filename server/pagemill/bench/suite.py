"""The suite: roofline, serving runs, router overhead and baselines in one run.

Order matters on a small machine: the server's runs first (nothing else
busy), then the server is stopped and the baselines run in this process on
the same requests, so no two of them compete for the cores.
"""

from __future__ import annotations

import json
import os
import shlex
import sys
import time

from pagemill.bench.datasets import make_dataset, random_dataset
from pagemill.bench.load import LoadConfig, Progress
from pagemill.bench.metrics import parse_goodput
from pagemill.bench.report import summary_markdown
from pagemill.bench.serve import LaunchedServer, serve_once


def idle_fraction(seconds: float = 2.0) -> float:
    """Share of CPU time spent idle over `seconds` (Linux /proc/stat; 1.0 elsewhere)."""

    def snap():
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        return v[3] + v[4], sum(v)  # idle + iowait, total

    try:
        i0, t0 = snap()
        time.sleep(seconds)
        i1, t1 = snap()
    except OSError:
        return 1.0
    return (i1 - i0) / max(1, t1 - t0)


def _tokenizer(model_dir: str):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json"))


def _percentiles(a) -> tuple[float, ...]:
    return tuple(float(p) for p in a.percentiles.split(",") if p)


def _load_cfg(a, base_url: str, concurrency: int | None) -> LoadConfig:
    return LoadConfig(base_url=base_url, endpoint=a.endpoint, request_rate=a.request_rate,
                      max_concurrency=concurrency, seed=a.seed, progress=not a.no_progress)  # fmt: skip


def serve_command(a) -> dict:
    from pagemill.bench.cli import resolve_model_dir

    tok = _tokenizer(resolve_model_dir(a.model_dir))
    requests = make_dataset(a.dataset, tok, a.num_prompts, a)
    run = serve_once(requests, _load_cfg(a, a.base_url, a.max_concurrency), parse_goodput(a.goodput),
                     _percentiles(a), label=a.dataset)  # fmt: skip
    m = run.result["metrics"]
    print(f"{a.dataset}: {m['completed']} ok, {m['failed']} failed in {m['duration_s']:.1f}s; "
          f"output {m['output_throughput']:.1f} tok/s, TTFT median {m['ttft']['median_ms']:.0f} ms, "
          f"TPOT median {m['tpot']['median_ms']:.1f} ms, overhead {100 * run.result['overhead']['overhead']:.1f}%")  # fmt: skip
    return run.result


def run_suite(a) -> dict:
    from pagemill.bench.cli import resolve_model_dir
    from pagemill.bench.roofline import roofline_report
    from pagemill.models.config import ModelConfig

    os.makedirs(a.out, exist_ok=True)
    model_dir = resolve_model_dir(a.model_dir)
    tok = _tokenizer(model_dir)
    slos, pcts = parse_goodput(a.goodput), _percentiles(a)
    results: dict = {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "args": _args_dict(a), "model_dir": model_dir}
    # Other users of the cores make every figure worse (2 OpenMP threads on a
    # busy 2-core machine slow down several times): record how idle it was.
    results["idle_before"] = idle_fraction()
    if results["idle_before"] < 0.8:
        _log(f"warning: the machine is only {100 * results['idle_before']:.0f}% idle before the run")
    _log("roofline: measuring bandwidth and matmul rate")
    results["roofline"] = roofline_report(ModelConfig.from_model_dir(model_dir))

    requests = make_dataset(a.dataset, tok, a.num_prompts, a)
    launch_args = ["--model", model_dir, *shlex.split(a.server_args)]
    with LaunchedServer(a.port, launch_args, os.path.join(a.out, "server.log")) as server:
        results["serve"] = []
        for c in a.concurrency:
            n = min(len(requests), max(a.min_prompts, 4 * c))
            _log(f"serve: {a.dataset}, concurrency {c}, {n} prompts")
            run = serve_once(requests[:n], _load_cfg(a, server.base_url, c), slos, pcts, label=f"c={c}")
            results["serve"].append(run.result)
            _log_run(run.result)
        # Overhead at a full batch: 64 requests of one length, all at once, so
        # (nearly) every decode step runs at batch 64.
        width = max(a.concurrency)
        same = random_dataset(tok, width, a.random_input_len, a.overhead_output_len, a.overhead_output_len, seed=a.seed)
        _log(f"overhead: {width} requests x {a.overhead_output_len} tokens, all at once")
        results["overhead_run"] = serve_once(same, _load_cfg(a, server.base_url, width), slos, pcts, "overhead").result
        _log_run(results["overhead_run"])
        results["extra"] = []
        for name in [d for d in a.extra_datasets.split(",") if d]:
            reqs = make_dataset(name, tok, a.num_prompts, a)
            _log(f"serve: {name}, concurrency {width}, {len(reqs)} prompts")
            run = serve_once(reqs, _load_cfg(a, server.base_url, width), slos, pcts, label=name)
            results["extra"].append(run.result)
            _log_run(run.result)

    results["baselines"] = [] if a.skip_baselines else _baselines(a, model_dir, tok, requests)
    results["idle_after"] = idle_fraction()
    _write(results, a.out)
    return results


def _baselines(a, model_dir: str, tok, requests) -> list[dict]:
    from pagemill.bench.baselines import hf_generate, load_hf

    model = load_hf(model_dir)
    out = []
    for b in a.hf_batch_sizes:
        _log(f"baseline: transformers static batches of {b}, {len(requests)} requests")
        p = Progress(len(requests), not a.no_progress, f"hf static {b}")
        out.append(hf_generate(model, tok, requests, b, f"transformers static b={b}", p).to_dict())
        p.close()
        _log(f"  {out[-1]['output_throughput']:.1f} output tok/s in {out[-1]['duration_s']:.1f}s")
    seq = requests[: a.sequential_prompts]
    _log(f"baseline: transformers request by request, first {len(seq)} requests")
    p = Progress(len(seq), not a.no_progress, "hf sequential")
    out.append(hf_generate(model, tok, seq, 1, "transformers sequential", p).to_dict())
    p.close()
    _log(f"  {out[-1]['output_throughput']:.1f} output tok/s in {out[-1]['duration_s']:.1f}s")
    return out


def _write(results: dict, out: str) -> None:
    from pagemill.bench.plots import all_plots

    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump(results, f, indent=1)
    try:
        results["plots"] = all_plots(results, out)
    except ImportError as e:  # matplotlib is in the optional `bench` extra
        _log(f"no plots: {e}")
    with open(os.path.join(out, "summary.md"), "w") as f:
        f.write(summary_markdown(results))
    _log(f"wrote {out}/results.json, summary.md and plots")


def _args_dict(a) -> dict:
    return {k: (str(v) if isinstance(v, float) and v == float("inf") else v) for k, v in vars(a).items()}


def _log(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


def _log_run(r: dict) -> None:
    m, o = r["metrics"], r["overhead"]
    _log(f"  {r['label']}: {m['completed']}/{r['num_prompts']} ok in {m['duration_s']:.1f}s, "
         f"{m['output_throughput']:.1f} out tok/s, TTFT p50 {m['ttft']['median_ms']:.0f} ms, "
         f"TPOT p50 {m['tpot']['median_ms']:.1f} ms, router overhead {100 * o['overhead']:.1f}% "
         f"({o['decode_steps']} steps, {o['mean_step_ms']:.1f} ms/step)"
         + (f" errors: {r['errors']}" if r["errors"] else ""))  # fmt: skip

