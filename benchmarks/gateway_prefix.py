"""Prompt tokens computed behind a router: the routers users put in front of
many servers, and pagemill's own data-parallel routing, on a shared-prefix
workload.

    python benchmarks/gateway_prefix.py

Workload: 8 system prompts (~1,100 tokens) x 8 short questions, shuffled
(seeded), 4 requests in flight, 8 greedy tokens each, OpenAI /v1/completions,
float32, the default model (SmolLM2-135M), 16-token KV blocks (what the
routers' block-based indexes assume). Every policy starts from fresh servers
(cold caches). `--systems`, `--questions`, `--rules` (prompt length) and
`--max-batch-prefill-tokens` shrink the workload for a small machine.

- single: one pagemill server alone (what computing each prefix once costs);
- pagemill --data-parallel 2 with --routing round-robin and prefix;
- two pagemill servers behind vllm-router with round_robin, cache_aware and
  kv_aware, the last fed by the servers' KV-cache events
  (--kv-events-config; --kv-event-source per server);
- two pagemill servers behind sglang-router cache_aware.

Prompt tokens computed are each server's `pagemill_prefill_tokens_total`
(before and after); the greedy texts of every policy are compared with the
single server's. The table goes to stdout; benchmarks/results/gateway-prefix/
latest.json gets the run and history.jsonl one row (date, commit, CPU flags,
figures). Token counts do not depend on the machine's load; wall times do.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack, contextmanager
from datetime import datetime, timezone

import httpx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _repo  # noqa: E402  (the repository from this file's path)
from pagemill.bench.compare_report import parse_cpuinfo  # noqa: E402
from pagemill.bench.history import append_history, cpu_record, git_commit  # noqa: E402
from pagemill.bench.serve import LaunchedServer  # noqa: E402

BLOCK = 16
RULES = 58  # rules per system prompt: ~1,100 tokens


def systems(rules: int = RULES) -> list[str]:
    return [f"You are assistant number {i} of the archive. " + " ".join(
        f"Rule {i}.{k}: the record {k * 37 % 101} of shelf {i} is filed under section {k % 13}." for k in range(rules))
        for i in range(8)]  # fmt: skip


SYSTEMS = systems()
QUESTIONS = ["What is rule one?", "Summarise the rules.", "Which shelf is yours?", "Say hello.",
             "Name a section.", "What comes last?", "Is anything missing?", "Who are you?"]  # fmt: skip
POLICIES = ("single", "pagemill-round-robin", "pagemill-prefix", "vllm-router-round_robin",
            "vllm-router-cache_aware", "vllm-router-kv_aware", "sglang-router-cache_aware")  # fmt: skip


def workload(seed: int, n_systems: int = len(SYSTEMS), questions: int = len(QUESTIONS),
             rules: int = RULES) -> list[tuple[int, str]]:
    items = [(i, f"{system}\nQuestion: {q}\nAnswer:") for i, (system, q) in
             enumerate((s, q) for s in systems(rules)[:n_systems] for q in QUESTIONS[:questions])]  # fmt: skip
    random.Random(seed).shuffle(items)
    return items


def prefill_tokens(url: str) -> float:
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("pagemill_prefill_tokens_total "):
            return float(line.split()[1])
    raise KeyError("pagemill_prefill_tokens_total")


async def drive(url: str, model: str, items: list[tuple[int, str]], in_flight: int, max_tokens: int) -> dict[int, str]:
    """`in_flight` workers take the next request as theirs finish; texts by request index."""
    queue, texts = list(items), {}

    async def worker(client: httpx.AsyncClient) -> None:
        while queue:
            i, prompt = queue.pop(0)
            body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
            r = await client.post(url + "/v1/completions", json=body)
            if r.status_code != 200:
                raise RuntimeError(f"request {i}: {r.status_code} {r.text[:300]}")
            texts[i] = r.json()["choices"][0]["text"]

    async with httpx.AsyncClient(timeout=900) as client:
        await asyncio.gather(*(worker(client) for _ in range(in_flight)))
    return texts


def wait_ready(url: str, proc: subprocess.Popen, log: str, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url} exited with {proc.returncode}; see {log}")
        try:
            if httpx.get(url + "/v1/models", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1.0)
    raise TimeoutError(f"{url} not ready after {timeout:.0f} s; see {log}")


@contextmanager
def router_process(argv: list[str], url: str, log: str):
    with open(log, "w") as f:
        proc = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_ready(url, proc, log)
        yield url
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


class Bench:
    def __init__(self, a: argparse.Namespace, model: str):
        self.a, self.model = a, model
        self.port = a.port
        os.makedirs(a.out, exist_ok=True)
        self.logs = a.logs or tempfile.mkdtemp(prefix="gateway-prefix-logs-")
        os.makedirs(self.logs, exist_ok=True)

    def next_port(self) -> int:
        self.port += 1
        return self.port

    def server_args(self, *extra: str) -> list[str]:
        prefill = self.a.max_batch_prefill_tokens
        max_input = min(2048, prefill)  # a prompt fits one prefill step
        return ["--model", self.model, "--dtype", "float32", "--block-size", str(BLOCK), "--max-input-tokens",
                str(max_input), "--max-total-tokens", str(max_input + 512), "--max-batch-prefill-tokens", str(prefill),
                *extra]  # fmt: skip

    def pagemill(self, stack: ExitStack, name: str, *extra: str) -> str:
        port = self.next_port()
        log = os.path.join(self.logs, f"{name}.log")
        return stack.enter_context(LaunchedServer(port, self.server_args(*extra), log)).base_url

    def two_servers(self, stack: ExitStack, name: str, events: bool) -> tuple[list[str], list[int]]:
        urls, pubs = [], []
        for k in range(2):
            extra: list[str] = []
            if events:
                pub = self.next_port()
                cfg = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{pub}"}
                extra = ["--kv-events-config", json.dumps(cfg)]
                pubs.append(pub)
            urls.append(self.pagemill(stack, f"{name}-server{k}", *extra))
        return urls, pubs

    def entry(self, stack: ExitStack, policy: str) -> tuple[str, list[str]]:
        """Where the workload goes for `policy`, and the servers whose prompt tokens count."""
        if policy == "single":
            url = self.pagemill(stack, policy)
            return url, [url]
        if policy.startswith("pagemill-"):
            url = self.pagemill(stack, policy, "--data-parallel", "2", "--routing", policy.removeprefix("pagemill-"))
            return url, [url]
        router, how = policy.split("-router-")
        urls, pubs = self.two_servers(stack, policy, events=how == "kv_aware")
        port, prom = self.next_port(), self.next_port()
        common = ["--worker-urls", *urls, "--policy", how, "--port", str(port), "--prometheus-port", str(prom)]
        if router == "vllm":
            argv = ["vllm-router", *common, "--log-level", self.a.router_log_level]
            for u, p in zip(urls, pubs):
                argv += ["--kv-event-source", f"{u}=tcp://127.0.0.1:{p}"]
            if pubs:
                argv += ["--kv-event-block-size", str(BLOCK), "--kv-event-model", self.model]
        else:
            argv = ["sglang-router", "launch", *common, "--log-level", "warn"]
        log = os.path.join(self.logs, f"{policy}-router.log")
        return stack.enter_context(router_process(argv, f"http://127.0.0.1:{port}", log)), urls

    def run(self, policy: str) -> dict:
        with ExitStack() as stack:
            url, servers = self.entry(stack, policy)
            before = sum(prefill_tokens(s) for s in servers)
            start = time.perf_counter()
            items = workload(self.a.seed, self.a.systems, self.a.questions, self.a.rules)
            model = httpx.get(servers[0] + "/v1/models", timeout=10).json()["data"][0]["id"]
            texts = asyncio.run(drive(url, model, items, self.a.in_flight, self.a.max_tokens))
            wall = time.perf_counter() - start
            time.sleep(0.5)
            computed = sum(prefill_tokens(s) for s in servers) - before
        return {"prompt_tokens_computed": int(computed), "wall_s": round(wall, 1), "texts": texts}


def available(policy: str) -> str | None:
    """Why `policy` cannot run here (its router is not installed), or None."""
    exe = {"vllm": "vllm-router", "sglang": "sglang-router"}.get(policy.split("-router-")[0])
    if "-router-" in policy and shutil.which(exe) is None:
        return f"{exe} is not installed (pip install the test extra)"
    return None


def table(results: dict) -> list[str]:
    single = results["single"]["prompt_tokens_computed"]
    rr = {"pagemill": "pagemill-round-robin", "vllm": "vllm-router-round_robin", "sglang": None}
    lines = [f"{'policy':<28}{'prompt tokens':>14}{'vs round-robin':>16}{'vs single':>11}{'outputs':>10}{'wall s':>8}"]
    for name, r in results.items():
        if "skipped" in r:
            lines.append(f"{name:<28}  skipped: {r['skipped']}")
            continue
        t = r["prompt_tokens_computed"]
        ref = rr.get(name.split("-")[0])
        fewer = f"{results[ref]['prompt_tokens_computed'] / t:.2f}x fewer" if ref in results and "skipped" not in \
            results[ref] and ref != name else ""  # fmt: skip
        same = "same" if r["outputs_identical"] else f"{r['outputs_differ']} differ"
        lines.append(f"{name:<28}{t:>14}{fewer:>16}{t / single:>10.2f}x{same:>10}{r['wall_s']:>8}")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model dir (default: the default model, SmolLM2-135M)")
    ap.add_argument("--out", default=_repo.results("gateway-prefix"))
    ap.add_argument("--port", type=int, default=9600, help="ports from here on")
    ap.add_argument("--systems", type=int, default=len(SYSTEMS), help="system prompts (at most 8)")
    ap.add_argument("--questions", type=int, default=len(QUESTIONS), help="questions per system prompt (at most 8)")
    ap.add_argument("--rules", type=int, default=RULES, help="rules per system prompt (58: ~1,100 tokens)")
    ap.add_argument("--max-batch-prefill-tokens", type=int, default=4096,
                    help="the servers' prefill step (warmup runs one this large)")
    ap.add_argument("--logs", default=None, help="folder for the servers' and routers' logs (default: a temporary one)")
    ap.add_argument("--in-flight", type=int, default=4)
    ap.add_argument("--router-log-level", default="warning",
                    help="vllm-router's --log-level (debug logs each kv_aware decision: the prefix it credited)")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--policies", default=",".join(POLICIES))
    a = ap.parse_args()
    if a.model is None:
        from pagemill.models.default_model import ensure_default_model

        a.model = str(ensure_default_model())
    bench, results = Bench(a, a.model), {}
    for policy in ["single", *[p for p in a.policies.split(",") if p != "single"]]:
        why = available(policy)
        results[policy] = {"skipped": why} if why else bench.run(policy)
        print(f"{policy}: {results[policy].get('prompt_tokens_computed', results[policy].get('skipped'))}", flush=True)
    reference = results["single"]["texts"]
    for r in results.values():
        if "texts" in r:
            r["outputs_differ"] = sum(r["texts"][i] != reference[i] for i in reference)
            r["outputs_identical"] = r["outputs_differ"] == 0
    lines = table(results)
    print("\n".join(["", f"{a.systems} system prompts x {a.questions} questions, {a.in_flight} in flight, float32, "
                         f"{BLOCK}-token blocks",
                     *lines]))  # fmt: skip
    write(a, results, lines)


def write(a: argparse.Namespace, results: dict, lines: list[str]) -> None:
    with open("/proc/cpuinfo") as f:
        cpu = cpu_record(parse_cpuinfo(f.read()))
    figures = {k: {f: v for f, v in r.items() if f != "texts"} for k, r in results.items()}
    run = {"date": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"), "commit": git_commit(_repo.ROOT),
           "cpu": cpu, "workload": {"systems": a.systems, "questions": a.questions, "in_flight": a.in_flight,
           "max_tokens": a.max_tokens, "seed": a.seed, "rules": a.rules,
           "max_batch_prefill_tokens": a.max_batch_prefill_tokens, "block_size": BLOCK, "dtype": "float32",
           "model": a.model},
           "policies": figures, "table": lines}  # fmt: skip
    with open(os.path.join(a.out, "latest.json"), "w") as f:
        json.dump({**run, "texts": {k: r.get("texts") for k, r in results.items()}}, f, indent=2)
    append_history(a.out, {k: run[k] for k in ("date", "commit", "cpu", "workload", "policies")})


if __name__ == "__main__":
    main()
