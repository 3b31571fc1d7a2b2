"""Serving metrics, named and defined as vLLM's `bench serve` defines them.

Per request (all times in seconds, from the moment the request was sent):
- TTFT: time to the first output token.
- TPOT: (E2E latency - TTFT) / (output tokens - 1): the mean time per output
  token *excluding the first*; undefined for 1-token outputs (left out).
- ITL: every gap between two consecutive output tokens (pooled over requests).
- E2E latency: time until the last token.
Whole run (duration: first send to last completion):
- request throughput = completed requests / duration
- output token throughput = output tokens of completed requests / duration
- total token throughput = (prompt + output tokens) / duration
- goodput = completed requests meeting every given SLO / duration, where a
  request meets `ttft:X` if TTFT <= X ms, `tpot:X` if TPOT <= X ms and
  `e2el:X` if E2E latency <= X ms (vLLM's --goodput).
Reported statistics are mean, median, std and the chosen percentiles (ms).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np

SLO_KEYS = ("ttft", "tpot", "e2el")


@dataclass
class RequestRecord:
    prompt_len: int
    start: float  # perf_counter when the request was sent
    token_times: list[float] = field(default_factory=list)  # perf_counter of each output token
    output_len: int = 0  # tokens generated (may exceed len(token_times) when a chunk holds several)
    success: bool = False
    error: str = ""

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.start

    @property
    def latency(self) -> float:
        return self.token_times[-1] - self.start

    @property
    def tpot(self) -> float | None:
        if self.output_len < 2:
            return None
        return (self.latency - self.ttft) / (self.output_len - 1)

    @property
    def itls(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:])]


@dataclass
class Stats:
    mean_ms: float
    median_ms: float
    std_ms: float
    percentiles_ms: dict[str, float]  # "p99" -> value

    @classmethod
    def of(cls, seconds: list[float], percentiles: tuple[float, ...]) -> "Stats":
        if not seconds:
            return cls(0.0, 0.0, 0.0, {f"p{_fmt(p)}": 0.0 for p in percentiles})
        ms = np.asarray(seconds, dtype=np.float64) * 1000.0
        return cls(
            float(ms.mean()), float(np.median(ms)), float(ms.std()),
            {f"p{_fmt(p)}": float(np.percentile(ms, p)) for p in percentiles},
        )  # fmt: skip


def _fmt(p: float) -> str:
    return str(int(p)) if float(p).is_integer() else str(p)


@dataclass
class BenchmarkMetrics:
    completed: int
    failed: int
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float  # req/s
    output_throughput: float  # tok/s
    total_token_throughput: float  # tok/s
    goodput: float | None  # req/s; None when no SLO was given
    ttft: Stats
    tpot: Stats
    itl: Stats
    e2el: Stats

    def to_dict(self) -> dict:
        return asdict(self)


def parse_goodput(items: list[str] | None) -> dict[str, float]:
    """['ttft:500', 'tpot:50'] -> {'ttft': 0.5, 'tpot': 0.05} (seconds)."""
    slos: dict[str, float] = {}
    for item in items or []:
        key, sep, value = item.partition(":")
        if not sep or key not in SLO_KEYS:
            raise ValueError(f"bad --goodput item {item!r}: use KEY:MS with KEY one of {', '.join(SLO_KEYS)}")
        ms = float(value)
        if ms <= 0:
            raise ValueError(f"--goodput {key} must be > 0 ms, got {value}")
        slos[key] = ms / 1000.0
    return slos


def meets_slos(r: RequestRecord, slos: dict[str, float]) -> bool:
    values = {"ttft": r.ttft, "tpot": r.tpot, "e2el": r.latency}
    # A 1-token request has no TPOT; like vLLM, it then meets a TPOT SLO.
    return all(values[k] is None or values[k] <= limit for k, limit in slos.items())


def compute_metrics(
    records: list[RequestRecord],
    duration_s: float,
    slos: dict[str, float] | None = None,
    percentiles: tuple[float, ...] = (99.0,),
) -> BenchmarkMetrics:
    done = [r for r in records if r.success and r.token_times]
    tpots = [r.tpot for r in done if r.tpot is not None]
    out_tokens = sum(r.output_len for r in done)
    in_tokens = sum(r.prompt_len for r in done)
    good = None
    if slos:
        good = sum(meets_slos(r, slos) for r in done) / duration_s
    return BenchmarkMetrics(
        completed=len(done),
        failed=len(records) - len(done),
        duration_s=duration_s,
        total_input_tokens=in_tokens,
        total_output_tokens=out_tokens,
        request_throughput=len(done) / duration_s,
        output_throughput=out_tokens / duration_s,
        total_token_throughput=(in_tokens + out_tokens) / duration_s,
        goodput=good,
        ttft=Stats.of([r.ttft for r in done], percentiles),
        tpot=Stats.of(tpots, percentiles),
        itl=Stats.of([x for r in done for x in r.itls], percentiles),
        e2el=Stats.of([r.latency for r in done], percentiles),
    )
