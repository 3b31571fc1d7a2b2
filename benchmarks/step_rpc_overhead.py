"""What one Step RPC costs around the model: gRPC both ways and the shard's service code.

    python benchmarks/step_rpc_overhead.py --rounds 3 --calls 2000 --batch 1 \
        --json benchmarks/results/step-rpc-overhead/step-rpc-b1.json

Serves the real ShardService (grpc.aio over a unix socket, shard/main.py's
serve_runner) in a child process with a runner that does no work (each
Step answers one Generation per entry), and times sequential Step calls
from a synchronous gRPC client in this process: the median round trip is
what the transport and the service add to a step. Modes, alternating per
round: `inline` (the shard's default: model calls run on the event loop's
thread) and `model-thread` (every model call handed to one worker thread
and its result back). The client is Python, slower than the router's
tonic client, so read the difference between the modes, not the absolute
times.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import _repo  # noqa: E402,F401  (the repository from this file's path)

MODES = ["inline", "model-thread"]


class NoWork:
    """A ModelRunner stand-in: what the service calls, answered at once."""

    def info(self):
        from pagemill.proto import pb

        return pb.InfoResponse(model_id="none")

    def health(self) -> None:
        pass

    store = None

    def step(self, req):
        from pagemill.proto import pb
        from pagemill.shard.model_runner import StepResult

        gens = [pb.Generation(request_id=r.id, tokens=pb.Tokens(ids=[5], logprobs=[-0.5])) for r in req.requests]
        return StepResult(gens, 1000)


def serve(path: str, mode: str) -> None:
    from pagemill.shard.main import serve_runner

    asyncio.run(serve_runner(NoWork(), path, inline=mode == "inline"))


def measure(mode: str, calls: int, batch: int) -> dict:
    import grpc

    from pagemill.proto import SERVICE_NAME, pb

    path = os.path.join(tempfile.mkdtemp(), "shard.sock")
    child = subprocess.Popen([sys.executable, __file__, "--serve", path, "--mode", mode])
    try:
        while not os.path.exists(path):
            if child.poll() is not None:
                raise RuntimeError(f"server exited {child.returncode}")
            time.sleep(0.05)
        channel = grpc.insecure_channel(f"unix://{path}")
        step = channel.unary_unary(f"/{SERVICE_NAME}/Step", request_serializer=pb.StepRequest.SerializeToString,
                                   response_deserializer=pb.StepResponse.FromString)  # fmt: skip
        req = pb.StepRequest(requests=[pb.ScheduledRequest(id=i, num_computed=70, num_tokens=1) for i in range(batch)])
        step(req, wait_for_ready=True)
        for _ in range(min(200, calls)):
            step(req)
        times = []
        for _ in range(calls):
            t = time.perf_counter_ns()
            step(req)
            times.append(time.perf_counter_ns() - t)
        channel.close()
    finally:
        child.terminate()
        child.wait(10)
    times.sort()
    return {"median_us": statistics.median(times) / 1e3, "p10_us": times[len(times) // 10] / 1e3}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--batch", type=int, default=1, help="entries per Step (one Generation each)")
    p.add_argument("--json", default=None)
    p.add_argument("--serve", default=None, help=argparse.SUPPRESS)
    p.add_argument("--mode", default="inline", choices=MODES, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.serve:
        serve(a.serve, a.mode)
        return
    runs = {m: [] for m in MODES}
    for r in range(a.rounds):
        for mode in MODES:
            runs[mode].append(measure(mode, a.calls, a.batch))
            print(f"round {r} {mode}: median {runs[mode][-1]['median_us']:.0f} us", flush=True)
    summary = {m: statistics.median(x["median_us"] for x in runs[m]) for m in MODES}
    print(f"| mode | Step round trip, median us (batch {a.batch}, {a.calls} calls x {a.rounds} rounds) |")
    print("| --- | ---: |")
    for m in MODES:
        print(f"| {m} | {summary[m]:.0f} |")
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps({"batch": a.batch, "calls": a.calls, "runs": runs, "median_us": summary},
                                           indent=2))  # fmt: skip


if __name__ == "__main__":
    main()
