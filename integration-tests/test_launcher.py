"""The launcher's life cycle: ready, clean stop on SIGTERM, loud exit when a shard dies."""

import concurrent.futures as cf
import os
import signal
import time

import httpx
import psutil

from server import HOLD_ARGS, HOLD_TOKENS, launch, sse_events


def shard_pids(server) -> list[int]:
    kids = psutil.Process(server.proc.pid).children(recursive=True)
    return [k.pid for k in kids if "shard" in " ".join(k.cmdline())]


def test_sigterm_stops_every_child(tiny_model_dir):
    s = launch(str(tiny_model_dir), "--kv-cache-memory", "64MiB")
    kids = psutil.Process(s.proc.pid).children(recursive=True)
    assert len(kids) >= 2
    assert httpx.post(f"{s.url}/generate", json={"inputs": "hi", "parameters": {"max_new_tokens": 3}},
                      timeout=60).status_code == 200
    assert s.stop(signal.SIGTERM) == 0
    gone, alive = psutil.wait_procs(kids, timeout=10)
    assert not alive, f"children left running: {alive}"


def test_shard_death_fails_requests_and_exits_nonzero(tiny_model_dir):
    s = launch(str(tiny_model_dir), "--kv-cache-memory", "64MiB", *HOLD_ARGS)
    pids = shard_pids(s)
    assert pids
    body = {"inputs": "hello there", "parameters": {"max_new_tokens": HOLD_TOKENS, "ignore_eos_token": True}}
    with cf.ThreadPoolExecutor(1) as pool:
        def stream():
            with httpx.stream("POST", f"{s.url}/generate_stream", json=body, timeout=60) as r:
                return list(sse_events(r))
        fut = pool.submit(stream)
        time.sleep(1.5)
        os.kill(pids[0], signal.SIGKILL)
        events = fut.result(timeout=60)
    assert events, "no events at all"
    assert events[-1].get("error_type") == "generation", events[-1]
    code = s.proc.wait(60)
    assert code != 0
    logs = s.logs()
    assert "shard 0 exited" in logs
