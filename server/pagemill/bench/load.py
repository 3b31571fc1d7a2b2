"""The load generator: Poisson (or all-at-once) arrivals, bounded concurrency.

As in vLLM's `bench serve`: with --request-rate R, gaps between sends are
exponential with mean 1/R (a Poisson process, seeded); with `inf` every
request is sent at t=0. --max-concurrency caps requests in flight (later
arrivals wait for a free slot, and their latency counts from the send).
"""

from __future__ import annotations

import asyncio
import math
import random
import sys
import time
from dataclasses import dataclass

import httpx

from pagemill.bench.datasets import SampleRequest
from pagemill.bench.endpoints import ENDPOINTS, send
from pagemill.bench.metrics import RequestRecord


@dataclass
class LoadConfig:
    base_url: str
    endpoint: str = "tgi"
    model: str = ""
    request_rate: float = math.inf
    max_concurrency: int | None = None
    seed: int = 0
    progress: bool = True
    timeout_s: float = 600.0
    # False: a fresh connection per request (llama.cpp's server closes the
    # connection after each streamed response; a compare run uses it for all).
    keepalive: bool = True


class Progress:
    """tqdm when installed, else one line rewritten in place."""

    def __init__(self, total: int, enabled: bool, desc: str) -> None:
        self.total, self.done, self.enabled, self.desc, self.bar = total, 0, enabled, desc, None
        if enabled:
            try:
                from tqdm import tqdm

                self.bar = tqdm(total=total, desc=desc, file=sys.stderr, leave=False)
            except ImportError:
                pass

    def update(self) -> None:
        self.done += 1
        if self.bar is not None:
            self.bar.update(1)
        elif self.enabled:
            print(f"\r{self.desc}: {self.done}/{self.total}", end="", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        elif self.enabled:
            print(file=sys.stderr)


async def run_load(requests: list[SampleRequest], cfg: LoadConfig, desc: str = "bench") -> tuple[list[RequestRecord], float]:
    """Returns every request's record and the duration (first send to last completion)."""
    ep = ENDPOINTS[cfg.endpoint]
    rng = random.Random(cfg.seed)
    limit = asyncio.Semaphore(cfg.max_concurrency or len(requests) or 1)
    progress = Progress(len(requests), cfg.progress, desc)
    keep = (cfg.max_concurrency or len(requests)) if cfg.keepalive else 0
    conns = httpx.Limits(max_connections=None, max_keepalive_connections=keep)
    timeout = httpx.Timeout(cfg.timeout_s, connect=30.0)

    async with httpx.AsyncClient(limits=conns, timeout=timeout) as client:

        async def one(req: SampleRequest) -> RequestRecord:
            async with limit:
                rec = await send(client, cfg.base_url, ep, req, cfg.model)
            progress.update()
            return rec

        start = time.perf_counter()
        tasks = []
        for req in requests:
            tasks.append(asyncio.create_task(one(req)))
            if math.isfinite(cfg.request_rate):
                await asyncio.sleep(rng.expovariate(cfg.request_rate))
        records = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    progress.close()
    return list(records), duration


async def warm(cfg: LoadConfig, request: SampleRequest, n: int = 2) -> None:
    """A few requests before measuring (lazy allocations, connection setup)."""
    ep = ENDPOINTS[cfg.endpoint]
    conns = httpx.Limits(max_keepalive_connections=None if cfg.keepalive else 0)
    async with httpx.AsyncClient(limits=conns, timeout=httpx.Timeout(cfg.timeout_s)) as client:
        for _ in range(n):
            rec = await send(client, cfg.base_url, ep, request, cfg.model)
            if not rec.success:
                raise RuntimeError(f"warm-up request failed: {rec.error}")
