"""Whether the machine is idle before a benchmark run: busy CPUs measured over a short window
from /proc/stat, not the 1-minute load average.

Why: the load average decays over minutes, so right after the previous server stops it still
shows that server's run. `bench compare` then waited its whole --idle-wait-s before every
start that followed another, and reported a load that was not there.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

STAT = "/proc/stat"


@dataclass(frozen=True)
class CpuTimes:
    """Jiffies since boot over all CPUs: busy (user, nice, system, irq, softirq) and total."""

    busy: int
    total: int


def parse_cpu_times(stat_text: str) -> CpuTimes:
    """The aggregate `cpu` line of /proc/stat. Idle and iowait are not busy; neither is steal
    (another guest on the host's CPU: our processes did not run then)."""
    line = next((ln for ln in stat_text.splitlines() if ln.startswith("cpu ")), None)
    if line is None:
        raise ValueError("no aggregate `cpu` line in /proc/stat")
    v = [int(x) for x in line.split()[1:9]] + [0] * 8
    user, nice, system, idle, iowait, irq, softirq, steal = v[:8]
    return CpuTimes(busy=user + nice + system + irq + softirq, total=sum(v[:8]))


def busy_cpus(before: CpuTimes, after: CpuTimes, ncpu: int) -> float:
    """How many CPUs were busy between two samples, on average (0 when no time passed)."""
    dt = after.total - before.total
    return 0.0 if dt <= 0 else max(0.0, (after.busy - before.busy) / dt * ncpu)


def sample_busy_cpus(window_s: float) -> float | None:
    """Busy CPUs over the next window_s seconds; None where /proc/stat cannot be read."""
    try:
        with open(STAT) as f:
            a = parse_cpu_times(f.read())
        time.sleep(window_s)
        with open(STAT) as f:
            b = parse_cpu_times(f.read())
    except (OSError, ValueError):
        return None
    return busy_cpus(a, b, os.cpu_count() or 1)


def wait_idle(max_busy: float, max_wait_s: float, window_s: float = 2.0) -> dict:
    """Waits until fewer than max_busy CPUs are busy over a window (or max_wait_s passes).
    Returns what it saw last: busy CPUs (None without /proc/stat, where the 1-minute load
    average decides instead), the load average, and whether it gave up."""
    deadline = time.monotonic() + max_wait_s
    while True:
        busy = sample_busy_cpus(window_s)
        load = os.getloadavg()[0]
        idle = (busy if busy is not None else load) < max_busy
        if idle or time.monotonic() >= deadline:
            return {"busy_cpus": busy, "load_avg": load, "idle": idle}
        if busy is None:
            time.sleep(5)
