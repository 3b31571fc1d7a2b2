"""bench/cpu_idle.py: busy CPUs from /proc/stat samples, and the wait before each start."""

from __future__ import annotations

import os

import pytest

from pagemill.bench import compare_report as rep
from pagemill.bench import cpu_idle

# user nice system idle iowait irq softirq steal guest guest_nice
STAT_A = "cpu  1000 10 200 5000 40 5 5 300 0 0\ncpu0 500 5 100 2500 20 2 2 150 0 0\nintr 1 2 3\n"
STAT_B = "cpu  1150 10 250 5100 60 5 5 420 0 0\ncpu0 575 5 125 2550 30 2 2 210 0 0\nintr 4 5 6\n"


def test_cpu_times_count_busy_work_not_idle_iowait_or_steal():
    a = cpu_idle.parse_cpu_times(STAT_A)
    assert a == cpu_idle.CpuTimes(busy=1000 + 10 + 200 + 5 + 5, total=1000 + 10 + 200 + 5000 + 40 + 5 + 5 + 300)


def test_busy_cpus_between_two_samples():
    a, b = cpu_idle.parse_cpu_times(STAT_A), cpu_idle.parse_cpu_times(STAT_B)
    # 200 busy jiffies of 440 (150 user + 50 system; 100 idle, 20 iowait, 120 steal) on 2 CPUs.
    assert cpu_idle.busy_cpus(a, b, 2) == pytest.approx(2 * 200 / 440)
    assert cpu_idle.busy_cpus(a, a, 2) == 0.0  # no time passed


def test_a_stat_without_the_cpu_line_is_an_error():
    with pytest.raises(ValueError, match="cpu"):
        cpu_idle.parse_cpu_times("intr 1 2 3\n")


def test_wait_idle_returns_at_the_first_idle_window(monkeypatch):
    seen = iter([1.7, 1.2, 0.3, 0.1])
    monkeypatch.setattr(cpu_idle, "sample_busy_cpus", lambda window_s: next(seen))
    out = cpu_idle.wait_idle(1.0, 60)
    assert out["idle"] and out["busy_cpus"] == 0.3 and next(seen) == 0.1  # no window after the idle one


def test_wait_idle_gives_up_after_its_wait_and_says_so(monkeypatch):
    monkeypatch.setattr(cpu_idle, "sample_busy_cpus", lambda window_s: 1.9)
    out = cpu_idle.wait_idle(1.0, 0)
    assert not out["idle"] and out["busy_cpus"] == 1.9


def test_without_proc_stat_the_load_average_decides(monkeypatch):
    monkeypatch.setattr(cpu_idle, "sample_busy_cpus", lambda window_s: None)
    monkeypatch.setattr(cpu_idle.os, "getloadavg", lambda: (0.4, 0.5, 0.6))
    out = cpu_idle.wait_idle(1.0, 60)
    assert out == {"busy_cpus": None, "load_avg": 0.4, "idle": True}


def test_this_machine_reads_a_plausible_figure():
    busy = cpu_idle.sample_busy_cpus(0.2)
    if busy is None:
        pytest.skip("no /proc/stat here")
    assert 0.0 <= busy <= (os.cpu_count() or 1) + 1e-6


def test_the_report_states_busy_cpus_when_runs_recorded_them():
    res = {"started": "now", "cpu": rep.parse_cpuinfo("processor : 0\nmodel name : X\nflags : avx2\n"),
           "command": "c", "args": {"num_prompts": 64, "concurrency": 64, "input_min": 32, "input_max": 256,
                                    "output_min": 16, "output_max": 256, "seed": 0, "batch1_prompts": 4,
                                    "batch1_output_len": 128},
           "servers": [{"name": "pm", "summary": {}, "runs": [{"load_before": 1.8, "busy_cpus_before": 0.04},
                                                              {"load_before": 1.5, "busy_cpus_before": 0.11}]}]}
    text = rep.summary_markdown(res, "TABLE")
    assert "pm 1.8/1.5" in text and "pm 0.04/0.11" in text
    del res["servers"][0]["runs"][0]["busy_cpus_before"], res["servers"][0]["runs"][1]["busy_cpus_before"]
    assert "Busy CPUs" not in rep.summary_markdown(res, "TABLE")  # results from before the busy figure
