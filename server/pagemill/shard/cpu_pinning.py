"""Where a CPU shard's threads run (--cpu-bind): each thread of the model's
OpenMP team on a core of its own, and the shard's other threads (the event
loop, gRPC's) on the model thread's core.

Why (measured, docs/cpu.md "Threads pinned to cores"): unpinned, the
event loop and gRPC threads ran on whichever core was free and so preempted
the OpenMP worker as often as the model thread; a preempted thread stalls
the other at the next barrier (a 64-sequence step has ~270). Pinned so,
64 concurrent requests went 3.6% faster (8 of 8 paired bursts) and batch-1
decode 14.74 -> 14.05 ms a token. The router and the load generator are
other processes and stay where the OS puts them.

Order matters, and serve() keeps it: the process's main thread is pinned
before it starts any other thread (they inherit its core), then the model
thread pins its team (cpu_kernels/csrc/common/threads.cpp) before its first parallel
region. Where the team cannot be pinned (no compiled kernels, fewer cores
than threads) nothing is pinned: the team's threads would inherit the main
thread's one core.
"""

from __future__ import annotations

import os
from dataclasses import dataclass


def parse_cpu_list(spec: str) -> list[int]:
    """'0-3,8' -> [0, 1, 2, 3, 8] (order kept, each core once); ValueError on anything else."""
    cores: list[int] = []
    for part in spec.split(","):
        lo, sep, hi = part.strip().partition("-")
        try:
            first, last = int(lo), int(hi) if sep else int(lo)
        except ValueError:
            raise ValueError(f"--cpu-bind: {part.strip()!r} is not a core or a range like 0-3") from None
        if first < 0 or last < first:
            raise ValueError(f"--cpu-bind: bad core range {part.strip()!r}")
        cores += [c for c in range(first, last + 1) if c not in cores]
    return cores


def explicit_cores(spec: str, allowed: set[int]) -> list[int]:
    """The cores of an explicit --cpu-bind list, all of which this process may use; ValueError
    otherwise (`launch` checks it before starting any shard)."""
    cores = parse_cpu_list(spec)
    if not set(cores) <= allowed:
        raise ValueError(f"--cpu-bind {spec}: cores {sorted(set(cores) - allowed)} are not allowed to this process "
                         f"(allowed: {sorted(allowed)})")  # fmt: skip
    return cores


@dataclass(frozen=True)
class Placement:
    cores: list[int]  # thread t of the model's team on cores[t]; cores[0] also the shard's other threads


def plan_placement(spec: str, allowed: set[int], threads: int, local_rank: int = 0) -> tuple[Placement | None, str]:
    """The cores of a shard running `threads` OpenMP threads, or None, with why. spec: --cpu-bind;
    allowed: the cores this process may run on; local_rank: auto's slice (shards started by hand
    on one host). Pure: no system calls."""
    if spec == "none":
        return None, "--cpu-bind none"
    if threads < 2:
        return None, f"{threads} thread: nothing to keep apart"
    if spec == "auto":
        ordered = sorted(allowed)
        cores = ordered[local_rank * threads : (local_rank + 1) * threads]
        if len(cores) < threads:
            return None, f"{len(ordered)} cores allowed, fewer than {threads} threads for local rank {local_rank}"
        return Placement(cores), "auto"
    cores = explicit_cores(spec, allowed)
    if len(cores) < threads:
        raise ValueError(f"--cpu-bind {spec}: {len(cores)} cores for {threads} threads (one core each)")
    return Placement(cores[:threads]), spec


def launch_slices(spec: str, allowed: set[int], processes: int, threads: int) -> list[str]:
    """--cpu-bind for each of `processes` CPU shards `launch` starts on this host: disjoint slices
    of `threads` cores under auto (or of an explicit list), else the spec as given. Pure."""
    if spec == "none" or processes < 2:
        return [spec] * processes
    cores = sorted(allowed) if spec == "auto" else explicit_cores(spec, allowed)
    if threads < 1 or len(cores) < processes * threads:
        return ["none"] * processes  # not enough cores to keep them apart: leave them to the OS
    return [",".join(map(str, cores[i * threads : (i + 1) * threads])) for i in range(processes)]


def allowed_cores() -> set[int] | None:
    """The cores this process may run on; None where the OS cannot say (no sched_getaffinity)."""
    get = getattr(os, "sched_getaffinity", None)
    return set(get(0)) if get is not None else None


def pin_this_thread(core: int) -> None:
    """The calling thread (and every thread it starts from now on) to `core` (Linux: pid 0 is the
    calling thread)."""
    os.sched_setaffinity(0, {core})


def pin_team(lib, cores: list[int]) -> bool:
    """On the model thread: its OpenMP team of len(cores) threads, thread t on cores[t]."""
    import ctypes

    array = (ctypes.c_int * len(cores))(*cores)
    return lib.pagemill_bind_team(len(cores), array) == 0
