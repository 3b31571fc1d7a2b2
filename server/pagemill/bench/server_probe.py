"""What the running server says about itself: /metrics counters and /info.

Router + scheduler overhead over a run is taken from two counters the router
exposes: decode_forward (what the shard reports it spent in the forward and
sampling) and decode_step (what the router measured around the whole step:
building slots, gRPC both ways, the shard's bookkeeping, streaming tokens).

    overhead = 1 - delta(forward) / delta(step)
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import httpx

FORWARD = "pagemill_decode_forward_seconds_total"
STEP = "pagemill_decode_step_seconds_total"
STEPS = "pagemill_decode_steps_total"
GENERATED = "pagemill_generated_tokens_total"


def scrape(base_url: str) -> dict[str, float]:
    text = httpx.get(base_url + "/metrics", timeout=30).text
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            try:
                values[name.strip()] = float(value)
            except ValueError:
                continue
    return values


def info(base_url: str) -> dict:
    return httpx.get(base_url + "/info", timeout=30).json()


@dataclass
class Overhead:
    decode_steps: int
    forward_s: float
    step_s: float
    overhead: float  # fraction of step time outside the shard's forward
    mean_step_ms: float
    mean_forward_ms: float

    def to_dict(self) -> dict:
        return asdict(self)


def overhead_between(before: dict[str, float], after: dict[str, float]) -> Overhead:
    fwd = after.get(FORWARD, 0.0) - before.get(FORWARD, 0.0)
    step = after.get(STEP, 0.0) - before.get(STEP, 0.0)
    steps = int(after.get(STEPS, 0.0) - before.get(STEPS, 0.0))
    frac = 1.0 - fwd / step if step > 0 else 0.0
    per = 1e3 / steps if steps else 0.0
    return Overhead(steps, fwd, step, frac, step * per, fwd * per)
