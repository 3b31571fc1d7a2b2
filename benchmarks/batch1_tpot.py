"""Batch-1 time per output token end to end, and where the router's step time goes.

    python benchmarks/batch1_tpot.py --python /path/to/venv/bin/python --label after \
        --python python3 --label before --rounds 3 --requests 5 \
        --args "--dtype bfloat16" --json benchmarks/results/batch1-tpot/batch1.json

Each (python, label) is one pagemill install; each round launches every
install in turn (a fresh server each time, alternating, so machine noise
hits them alike), sends `--requests` sequential streaming /v1/completions
(64 prompt token ids, `--output` tokens, ignore_eos) and stops it. Per
server: median time per output token over the requests ((last token time -
first token time) / (tokens - 1), client clock), and from /metrics before
and after the load: the router's decode step time (send to reply,
pagemill_decode_step_seconds_total), the shard's forward time
(pagemill_decode_forward_seconds_total) and the decode steps, so that per
step: wall = tpot, router round trip = step, shard model + sampling =
forward, gRPC + shard Python around the forward = step - forward, and the
router's time between steps (scheduling, stream delivery) = tpot - step.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import _repo  # noqa: E402,F401  (the repository from this file's path)


def launch(python: str, port: int, args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    cmd = [python, "-m", "pagemill", "launch", "--port", str(port), *args]
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True,
                            env=dict(os.environ, **env))  # fmt: skip
    deadline = time.time() + 300
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited {proc.returncode}; see {log}")
        try:
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            c.request("GET", "/health")
            if c.getresponse().status == 200:
                return proc
        except OSError:
            pass
        time.sleep(1)
    stop(proc)
    raise RuntimeError(f"server not ready in 300 s; see {log}")


def stop(proc: subprocess.Popen) -> None:
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def metrics(port: int) -> dict[str, float]:
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    c.request("GET", "/metrics")
    out = {}
    for line in c.getresponse().read().decode().splitlines():
        if line.startswith("pagemill_decode_") and " " in line and "{" not in line:
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def one_request(port: int, prompt: list[int], output: int) -> float:
    """Streams one completion; returns its time per output token in ms."""
    body = json.dumps({"model": "m", "prompt": prompt, "max_tokens": output, "ignore_eos": True, "stream": True,
                       "temperature": 0})  # fmt: skip
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    c.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    r = c.getresponse()
    stamps = []
    for raw in r:
        line = raw.strip()
        if line.startswith(b"data:") and line != b"data: [DONE]":
            stamps.append(time.perf_counter())
    if len(stamps) < 2:
        raise RuntimeError(f"stream gave {len(stamps)} events")
    return (stamps[-1] - stamps[0]) / (len(stamps) - 1) * 1e3


def measure(python: str, port: int, args: list[str], env: dict[str, str], requests: int, output: int,
            log: Path) -> dict:  # fmt: skip
    proc = launch(python, port, args, env, log)
    try:
        rng = random.Random(0)
        one_request(port, [rng.randrange(100, 40000) for _ in range(64)], 8)  # warm
        m0 = metrics(port)
        tpots = [one_request(port, [rng.randrange(100, 40000) for _ in range(64)], output) for _ in range(requests)]
        m1 = metrics(port)
    finally:
        stop(proc)
    d = {k: m1[k] - m0.get(k, 0.0) for k in m1}
    steps = d.get("pagemill_decode_steps_total", 0.0) or 1.0
    step_ms = d.get("pagemill_decode_step_seconds_total", 0.0) / steps * 1e3
    fwd_ms = d.get("pagemill_decode_forward_seconds_total", 0.0) / steps * 1e3
    return {"tpot_ms": statistics.median(tpots), "tpots": tpots, "step_ms": step_ms, "forward_ms": fwd_ms,
            "steps": steps}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--python", action="append", required=True, help="interpreter of one install (repeat)")
    p.add_argument("--label", action="append", required=True, help="its name (one per --python)")
    p.add_argument("--args", action="append", default=None,
                   help="launch flags: once for every server, or once per --python (default --dtype bfloat16)")
    p.add_argument("--env", action="append", default=None,
                   help="KEY=VALUE[,KEY=VALUE] for the server: once for all, or once per --python ('' for none)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--requests", type=int, default=5)
    p.add_argument("--output", type=int, default=128)
    p.add_argument("--port", type=int, default=3400)
    p.add_argument("--json", default=None)
    a = p.parse_args()
    if len(a.python) != len(a.label):
        sys.exit("one --label per --python")
    args = a.args or ["--dtype bfloat16"]
    if len(args) == 1:
        args = args * len(a.python)
    if len(args) != len(a.python):
        sys.exit("--args once, or once per --python")
    envs = [dict(kv.split("=", 1) for kv in e.split(",") if kv) for e in (a.env or [""])]
    if len(envs) == 1:
        envs = envs * len(a.python)
    if len(envs) != len(a.python):
        sys.exit("--env once, or once per --python")
    runs: dict[str, list[dict]] = {label: [] for label in a.label}
    for r in range(a.rounds):
        for python, label, flags, env in zip(a.python, a.label, args, envs):
            log = Path(f"/tmp/batch1_tpot-{label}-{r}.log")
            res = measure(python, a.port, flags.split(), env, a.requests, a.output, log)
            runs[label].append(res)
            print(f"round {r} {label}: tpot {res['tpot_ms']:.2f} ms, step {res['step_ms']:.2f}, "
                  f"forward {res['forward_ms']:.2f}", flush=True)  # fmt: skip
    print("| install | tpot ms | router step ms | shard forward ms | step - forward | tpot - step |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    summary = {}
    for label, rs in runs.items():
        med = {k: statistics.median(x[k] for x in rs) for k in ("tpot_ms", "step_ms", "forward_ms")}
        summary[label] = med
        print(f"| {label} | {med['tpot_ms']:.2f} | {med['step_ms']:.2f} | {med['forward_ms']:.2f} | "
              f"{med['step_ms'] - med['forward_ms']:.2f} | {med['tpot_ms'] - med['step_ms']:.2f} |")  # fmt: skip
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps({"args": dict(zip(a.label, args)), "env": dict(zip(a.label, envs)), "runs": runs, "median": summary}, indent=2))


if __name__ == "__main__":
    main()
