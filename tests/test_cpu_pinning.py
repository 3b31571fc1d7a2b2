"""shard/cpu_pinning.py: --cpu-bind's parsing and plans (pure), and the pinning itself in a child
process (real kernels, real OpenMP team)."""

import json
import os
import subprocess
import sys

import pytest

from pagemill.shard.cpu_pinning import launch_slices, parse_cpu_list, plan_placement


def test_parse_cpu_list():
    assert parse_cpu_list("0-3,8") == [0, 1, 2, 3, 8]
    assert parse_cpu_list("2, 2,1") == [2, 1]  # order kept, each core once
    assert parse_cpu_list("5") == [5]
    for bad in ["a", "3-1", "-1", "", "1,,2", "0-x"]:
        with pytest.raises(ValueError, match="--cpu-bind"):
            parse_cpu_list(bad)


def test_plan_auto_and_none():
    plan, _ = plan_placement("auto", {0, 1}, 2)
    assert plan.cores == [0, 1]
    plan, _ = plan_placement("auto", {4, 2, 3, 5}, 2, local_rank=1)  # a second shard by hand: the next slice
    assert plan.cores == [4, 5]
    assert plan_placement("auto", {0, 1, 2, 3}, 3)[0].cores == [0, 1, 2]
    for args in [("none", {0, 1}, 2), ("auto", {0, 1}, 1), ("auto", {0}, 2), ("auto", {0, 1, 2}, 2, 1)]:
        plan, why = plan_placement(*args)
        assert plan is None and why


def test_plan_explicit():
    assert plan_placement("3,1", {0, 1, 2, 3}, 2)[0].cores == [3, 1]
    assert plan_placement("0-3", {0, 1, 2, 3}, 2)[0].cores == [0, 1]  # the first `threads` of the list
    with pytest.raises(ValueError, match="not allowed"):
        plan_placement("0,7", {0, 1}, 2)
    with pytest.raises(ValueError, match="1 cores for 2 threads"):
        plan_placement("1", {0, 1}, 2)


def test_launch_slices():
    assert launch_slices("auto", {0, 1, 2, 3}, 2, 2) == ["0,1", "2,3"]
    assert launch_slices("auto", {0, 1, 2, 3, 4}, 2, 2) == ["0,1", "2,3"]
    assert launch_slices("4-7", {0, 1, 2, 3, 4, 5, 6, 7}, 2, 2) == ["4,5", "6,7"]
    assert launch_slices("auto", {0, 1}, 2, 2) == ["none", "none"]  # not enough cores: the OS places them
    assert launch_slices("auto", {0, 1}, 1, 0) == ["auto"]
    assert launch_slices("none", {0, 1, 2, 3}, 2, 2) == ["none", "none"]


CHILD = """
import json, os, sys, torch
from pagemill.cpu_kernels.build import library
from pagemill.shard.cpu_pinning import pin_team, pin_this_thread
cores = [int(c) for c in sys.argv[1].split(",")]
pin_this_thread(cores[0])
torch.set_num_threads(len(cores))
ok = pin_team(library(), cores)
torch.ones(1 << 24).sum()  # a parallel region of torch's, on the same team
def allowed(tid):
    for line in open(f"/proc/self/task/{tid}/status"):
        if line.startswith("Cpus_allowed_list"):
            return line.split()[1]
print(json.dumps({"ok": ok, "me": allowed(os.getpid()), "threads": sorted(allowed(t) for t in os.listdir("/proc/self/task"))}))
"""


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs two cores this process may use")  # fmt: skip
def test_team_pinned_one_thread_per_core():
    from pagemill.cpu_kernels.build import library

    if library() is None:
        pytest.skip("no compiled CPU kernels here")
    c0, c1 = sorted(os.sched_getaffinity(0))[:2]
    out = subprocess.run([sys.executable, "-c", CHILD, f"{c1},{c0}"], capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)), check=True)  # fmt: skip
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["ok"]
    assert r["me"] == str(c1)  # the main thread, the team's thread 0 here
    assert str(c0) in r["threads"]  # the team's other thread, on the other core


def test_launcher_gives_each_cpu_shard_its_slice(monkeypatch):
    import argparse

    from pagemill import launcher

    monkeypatch.setattr(launcher, "allowed_cores", lambda: {0, 1, 2, 3, 4, 5, 6, 7})
    a = argparse.Namespace(num_shard=2, data_parallel=2, device="cpu", cpu_bind="auto")
    assert launcher._cpu_binds(a, 2) == ["0,1", "2,3", "4,5", "6,7"]  # group g, rank r: g * num_shard + r
    a.device = "cuda"
    assert launcher._cpu_binds(a, 2) == ["auto"] * 4  # not ours to place
    a = argparse.Namespace(num_shard=1, data_parallel=1, device="cpu", cpu_bind="auto")
    assert launcher._cpu_binds(a, 0) == ["auto"]  # one shard: it plans its own


def test_launcher_refuses_a_bad_list_before_starting_shards(monkeypatch):
    import argparse

    from pagemill import launcher

    monkeypatch.setattr(launcher, "allowed_cores", lambda: {0, 1})
    for bad, match in [("0-x", "is not a core"), ("0,5", "not allowed")]:
        a = argparse.Namespace(num_shard=1, data_parallel=1, device="cpu", cpu_bind=bad)
        with pytest.raises(ValueError, match=match):
            launcher._cpu_binds(a, 0)
