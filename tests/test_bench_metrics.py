"""Serving-benchmark metric math on synthetic timestamps (no server, no model)."""

from __future__ import annotations

import pytest

from pagemill.bench.metrics import RequestRecord, compute_metrics, parse_goodput


def record(start, times, prompt_len=10, success=True):
    return RequestRecord(prompt_len=prompt_len, start=start, token_times=list(times), output_len=len(times),
                         success=success)  # fmt: skip


def test_per_request_definitions():
    # Sent at 1.0; tokens at 1.5, 1.7, 2.0, 2.1
    r = record(1.0, [1.5, 1.7, 2.0, 2.1])
    assert r.ttft == pytest.approx(0.5)
    assert r.latency == pytest.approx(1.1)
    # TPOT excludes the first token: (1.1 - 0.5) / 3
    assert r.tpot == pytest.approx(0.2)
    assert r.itls == pytest.approx([0.2, 0.3, 0.1])
    assert record(0.0, [0.3]).tpot is None  # one token: no TPOT


def test_run_metrics_and_stats():
    recs = [
        record(0.0, [0.1, 0.2, 0.3], prompt_len=5),  # ttft 100ms, tpot 100ms, e2el 300ms
        record(0.0, [0.3, 0.5], prompt_len=7),  # ttft 300ms, tpot 200ms, e2el 500ms
        record(0.0, [], prompt_len=9, success=False),
    ]
    m = compute_metrics(recs, duration_s=2.0, percentiles=(50, 99))
    assert (m.completed, m.failed) == (2, 1)
    assert (m.total_input_tokens, m.total_output_tokens) == (12, 5)
    assert m.request_throughput == pytest.approx(1.0)
    assert m.output_throughput == pytest.approx(2.5)
    assert m.total_token_throughput == pytest.approx(8.5)
    assert m.ttft.mean_ms == pytest.approx(200.0) and m.ttft.median_ms == pytest.approx(200.0)
    assert m.ttft.std_ms == pytest.approx(100.0)
    assert m.ttft.percentiles_ms["p99"] == pytest.approx(100 + 0.99 * 200)
    assert m.tpot.mean_ms == pytest.approx(150.0)
    assert m.itl.mean_ms == pytest.approx((100 + 100 + 200) / 3)
    assert m.e2el.median_ms == pytest.approx(400.0)
    assert m.goodput is None


def test_goodput_counts_requests_meeting_every_slo():
    recs = [
        record(0.0, [0.1, 0.2, 0.3]),  # ttft 100, tpot 100, e2el 300
        record(0.0, [0.3, 0.5]),  # ttft 300, tpot 200, e2el 500
        record(0.0, [0.05]),  # one token: no TPOT, meets a tpot SLO
    ]
    slos = parse_goodput(["ttft:150", "tpot:120"])
    assert slos == {"ttft": pytest.approx(0.15), "tpot": pytest.approx(0.12)}
    assert compute_metrics(recs, 4.0, slos).goodput == pytest.approx(2 / 4.0)
    assert compute_metrics(recs, 1.0, parse_goodput(["e2el:400"])).goodput == pytest.approx(2.0)
    assert compute_metrics(recs, 1.0, parse_goodput(["ttft:400", "e2el:600"])).goodput == pytest.approx(3.0)


def test_goodput_parsing_errors():
    for bad in (["ttft"], ["foo:1"], ["tpot:-3"]):
        with pytest.raises(ValueError):
            parse_goodput(bad)


def test_empty_run():
    m = compute_metrics([], 1.0, percentiles=(99,))
    assert m.completed == 0 and m.ttft.percentiles_ms == {"p99": 0.0}
