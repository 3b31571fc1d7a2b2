"""pagemill as a Ray Serve application.

Each replica starts its own `pagemill launch` (shards and router) on free ports of its
node and relays every HTTP route to it, OpenAI streams included; Ray Serve spreads the
requests over the replicas and scales their number on ongoing requests. A replica whose
server dies ends its open streams with an error event, answers 503 until Serve replaces
it (its health check fails), and the other replicas keep serving.

    serve run pagemill.serve.ray_app:app_builder model=HuggingFaceTB/SmolLM2-135M-Instruct \\
        min_replicas=1 max_replicas=4 target_ongoing_requests=16 launch_args="--max-batch-size 64"

(docs/deploy.md). Needs `pip install 'pagemill[ray]'`.
"""

from __future__ import annotations

import shlex
from typing import Any

import httpx
from ray import serve
from ray.serve import Application
from starlette.requests import Request
from starlette.responses import Response

from pagemill.serve.local_server import LocalServer
from pagemill.serve.relay import relay, unavailable

# Serve's defaults for this application; `app_builder` arguments override them.
AUTOSCALING = {"min_replicas": 1, "max_replicas": 4, "target_ongoing_requests": 16,
               "upscale_delay_s": 10, "downscale_delay_s": 120}
MAX_ONGOING_REQUESTS = 128


@serve.deployment(
    autoscaling_config=AUTOSCALING,
    max_ongoing_requests=MAX_ONGOING_REQUESTS,
    # A dead server is noticed within seconds; its replica is then replaced.
    health_check_period_s=2,
    health_check_timeout_s=15,
    graceful_shutdown_timeout_s=40,
    ray_actor_options={"num_cpus": 1},
)
class PagemillReplica:
    """One replica: a `pagemill launch` of its own, and the relay in front of it."""

    def __init__(self, model: str, launch_args: list[str] | None = None, ready_timeout_s: float = 900):
        self.server = LocalServer.start(model, launch_args or [], timeout=ready_timeout_s)
        self.http = httpx.AsyncClient(base_url=self.server.url, timeout=httpx.Timeout(None, connect=10))
        # Which server answered (the launcher's pid on its node): for logs and tests.
        self.identity = {"x-pagemill-pid": str(self.server.pid)}

    async def __call__(self, request: Request) -> Response:
        if not self.server.alive():
            return unavailable("this replica's pagemill server has exited; the replica is being replaced")
        return await relay(self.http, request, self.identity)

    async def check_health(self) -> None:
        """Serve's health check: the server process runs and its /health answers 200."""
        if not self.server.alive():
            raise RuntimeError(f"pagemill launch exited with {self.server.proc.returncode}")
        r = await self.http.get("/health", timeout=10)
        if r.status_code != 200:
            raise RuntimeError(f"pagemill /health answered {r.status_code}: {r.text[:200]}")

    def __del__(self) -> None:
        server = getattr(self, "server", None)
        if server is not None:
            server.stop()


def app_builder(args: dict[str, Any]) -> Application:
    """`serve run pagemill.serve.ray_app:app_builder model=... [launch_args="..."]
    [min_replicas=N max_replicas=N target_ongoing_requests=N] [num_cpus=N num_gpus=N]`."""
    args = dict(args)
    model = args.pop("model")
    launch_args = args.pop("launch_args", [])
    if isinstance(launch_args, str):
        launch_args = shlex.split(launch_args)
    autoscaling = {**AUTOSCALING, **{k: int(args.pop(k)) for k in list(args) if k in AUTOSCALING}}
    actor = {k: float(args.pop(k)) for k in ("num_cpus", "num_gpus") if k in args}
    ready_timeout_s = float(args.pop("ready_timeout_s", 900))
    if args:
        raise ValueError(f"unknown arguments: {sorted(args)}")
    deployment = PagemillReplica.options(autoscaling_config=autoscaling,
                                         ray_actor_options={"num_cpus": 1, **actor})
    return deployment.bind(model, launch_args, ready_timeout_s)
