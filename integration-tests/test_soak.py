"""Soak: 2,000 requests at 64 concurrent clients, every API flavour mixed,
streaming and not. Every answer is checked complete and correct, every KV
block is free at the end, and the router's RSS shows no growth trend."""

import asyncio
import os
import random
import statistics
import threading
import time

import httpx
import pytest

from reliability import FLAVOURS, check, request, router_process, wait_idle
from server import launch

REQUESTS = int(os.environ.get("PAGEMILL_SOAK_REQUESTS", "2000"))
CONCURRENCY = int(os.environ.get("PAGEMILL_SOAK_CONCURRENCY", "64"))


class RssSampler(threading.Thread):
    """RSS of the router process every `period` seconds while the load runs."""

    def __init__(self, proc, period: float = 0.25):
        super().__init__(daemon=True)
        self.proc, self.period = proc, period
        self.samples: list[int] = []
        self.stopped = threading.Event()

    def run(self):
        while not self.stopped.wait(self.period):
            self.samples.append(self.proc.memory_info().rss)


async def _run(url: str, plan: list[tuple[str, int]]) -> tuple[list[str], int]:
    failures: list[str] = []
    done = 0
    sem = asyncio.Semaphore(CONCURRENCY)
    limits = httpx.Limits(max_connections=CONCURRENCY, max_keepalive_connections=CONCURRENCY)
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:
        async def one(i: int, flavour: str, n: int):
            nonlocal done
            async with sem:
                path, body = request(flavour, i, n)
                try:
                    r = await client.post(url + path, json=body)
                    check(flavour, n, r.status_code, r.content)
                    done += 1
                except (AssertionError, httpx.HTTPError, ValueError) as e:
                    failures.append(f"#{i} {flavour} n={n}: {type(e).__name__}: {e}"[:400])

        await asyncio.gather(*(one(i, f, n) for i, (f, n) in enumerate(plan)))
    return failures, done


@pytest.mark.timeout(420)
def test_soak_2000_mixed_requests(tiny_model_dir):
    # A pool small enough (2,047 blocks) that the prefix cache fills early and
    # evicts from then on: its growth is bounded and over by the second quarter.
    s = launch(str(tiny_model_dir), "--kv-cache-memory", "16MiB", "--max-concurrent-requests", "128",
               "--max-input-tokens", "256", "--max-total-tokens", "512")
    try:
        router = router_process(s)
        rng = random.Random(8)
        plan = [(FLAVOURS[i % len(FLAVOURS)], rng.randint(1, 24)) for i in range(REQUESTS)]
        rng.shuffle(plan)
        sampler = RssSampler(router)
        sampler.start()
        t0 = time.monotonic()
        failures, done = asyncio.run(_run(s.url, plan))
        elapsed = time.monotonic() - t0
        sampler.stopped.set()
        sampler.join()
        info = wait_idle(s)

        rss = sampler.samples
        q = len(rss) // 4
        second, last = statistics.median(rss[q:2 * q]), statistics.median(rss[3 * q:])
        mib = 1 << 20
        print(f"\nsoak: {done}/{REQUESTS} ok at concurrency {CONCURRENCY} in {elapsed:.1f}s "
              f"({REQUESTS / elapsed:.1f} req/s); router RSS MiB: min {min(rss) / mib:.1f} "
              f"q2-median {second / mib:.1f} q4-median {last / mib:.1f} max {max(rss) / mib:.1f} "
              f"({len(rss)} samples); kv blocks used at end {info['kv_blocks_used']}/{info['kv_blocks_total']} "
              f"(cached {info['kv_blocks_cached']})")
        tenths = [statistics.median(rss[i * len(rss) // 10:(i + 1) * len(rss) // 10]) / mib for i in range(10)]
        print("soak: router RSS median per tenth of the run (MiB): " + " ".join(f"{x:.1f}" for x in tenths))
        assert not failures, f"{len(failures)} bad answers, first: {failures[:5]}"
        assert done == REQUESTS
        assert info["kv_blocks_used"] == 0 and info["kv_blocks_free"] == info["kv_blocks_total"]
        assert len(rss) >= 20, "too few RSS samples to see a trend"
        # No growth trend: the last quarter's median within 10% (+16 MiB of
        # allocator slack) of the second quarter's, once warm.
        assert last <= second * 1.10 + 16 * mib, (second / mib, last / mib)
        assert s.metric("pagemill_requests_failed_total") == 0
        assert s.metric("pagemill_requests_total") == REQUESTS
    finally:
        s.stop()

