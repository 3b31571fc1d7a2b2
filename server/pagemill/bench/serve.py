"""One serving benchmark run against a server, and a server started for a suite."""

from __future__ import annotations

import asyncio
import math
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

import httpx

from pagemill.bench.datasets import SampleRequest
from pagemill.bench.load import LoadConfig, run_load, warm
from pagemill.bench.metrics import compute_metrics
from pagemill.bench.server_probe import overhead_between, scrape


@dataclass
class ServeRun:
    label: str
    max_concurrency: int | None
    request_rate: float
    result: dict  # metrics, overhead, per-request values, errors


def serve_once(requests: list[SampleRequest], cfg: LoadConfig, slos: dict, percentiles: tuple,
               label: str = "serve", do_warm: bool = True) -> ServeRun:  # fmt: skip
    if do_warm:
        asyncio.run(warm(cfg, SampleRequest(requests[0].prompt, requests[0].prompt_len, 4)))
    before = scrape(cfg.base_url)
    records, duration = asyncio.run(run_load(requests, cfg, desc=label))
    after = scrape(cfg.base_url)
    metrics = compute_metrics(records, duration, slos, percentiles)
    ok = [r for r in records if r.success and r.token_times]
    result = {
        "label": label,
        "max_concurrency": cfg.max_concurrency or len(requests),
        "request_rate": "inf" if math.isinf(cfg.request_rate) else cfg.request_rate,
        "num_prompts": len(requests),
        "metrics": metrics.to_dict(),
        "overhead": overhead_between(before, after).to_dict(),
        "per_request": {
            "ttft_ms": [1e3 * r.ttft for r in ok],
            "tpot_ms": [1e3 * r.tpot for r in ok if r.tpot is not None],
            "e2el_ms": [1e3 * r.latency for r in ok],
        },
        "errors": sorted({r.error for r in records if r.error})[:5],
    }
    return ServeRun(label, cfg.max_concurrency, cfg.request_rate, result)


class LaunchedServer:
    """`pagemill launch` in a child process, for as long as the `with` block lasts."""

    def __init__(self, port: int, extra_args: list[str], log_path: str, timeout_s: float = 600) -> None:
        self.port, self.extra, self.log_path, self.timeout_s = port, extra_args, log_path, timeout_s
        self.base_url = f"http://127.0.0.1:{port}"
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> "LaunchedServer":
        self.log = open(self.log_path, "w")
        cmd = [sys.executable, "-m", "pagemill", "launch", "--port", str(self.port), *self.extra]
        env = dict(os.environ)
        # Own process group, so stopping it stops shard and router too.
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        deadline = time.monotonic() + self.timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}; see {self.log_path}")
            try:
                if httpx.get(self.base_url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(1.0)
        self.__exit__(None, None, None)
        raise TimeoutError(f"server not healthy after {self.timeout_s}s; see {self.log_path}")

    def __exit__(self, *exc) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)  # the launcher stops router, then shards
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()
