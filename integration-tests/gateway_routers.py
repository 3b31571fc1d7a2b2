"""Starts the real routers that sit in front of many servers (PyPI `vllm-router`
and `sglang-router`, the `test` extra) in a subprocess for tests."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import httpx

from server import free_port

# The command line each router is started with (docs/deploy.md shows the same).
COMMANDS = {
    "vllm-router": lambda workers, port, prom, policy: [
        "vllm-router", "--worker-urls", *workers, "--policy", policy, "--host", "127.0.0.1",
        "--port", str(port), "--prometheus-port", str(prom), "--log-level", "warning"],
    "sglang-router": lambda workers, port, prom, policy: [
        "sglang-router", "launch", "--worker-urls", *workers, "--policy", policy, "--host", "127.0.0.1",
        "--port", str(port), "--prometheus-port", str(prom), "--log-level", "warn"],
}


@dataclass
class Router:
    name: str
    proc: subprocess.Popen
    port: int
    log: deque = field(default_factory=lambda: deque(maxlen=300))

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def logs(self) -> str:
        return "\n".join(self.log)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)


def start_router(name: str, workers: list[str], model_id: str, timeout: float = 60, policy: str = "cache_aware",
                 extra: tuple[str, ...] = ()) -> Router:
    """`name` in front of `workers` with `policy` (and `extra` arguments), ready once it lists
    `model_id` and a chat request goes through."""
    if shutil.which(name) is None:
        raise RuntimeError(f"`{name}` is not installed: pip install -e '.[test]'")
    port = free_port()
    argv = [*COMMANDS[name](workers, port, free_port(), policy), *extra]
    env = dict(os.environ, HF_HUB_OFFLINE="1", RUST_LOG="warn")
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    router = Router(name, proc, port)

    def pump():
        for raw in proc.stdout:
            router.log.append(raw.decode(errors="replace").rstrip())

    threading.Thread(target=pump, daemon=True).start()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited with {proc.returncode}:\n{router.logs()}")
        if _serves(router, model_id):
            return router
        time.sleep(0.5)
    router.stop()
    raise TimeoutError(f"{name} not ready after {timeout}s:\n{router.logs()}")


def _serves(router: Router, model_id: str) -> bool:
    try:
        models = httpx.get(f"{router.url}/v1/models", timeout=5)
        if models.status_code != 200 or model_id not in {m["id"] for m in models.json().get("data", [])}:
            return False
        probe = httpx.post(f"{router.url}/v1/chat/completions", timeout=30, json={
            "model": model_id, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})
        return probe.status_code == 200
    except (httpx.HTTPError, ValueError):
        return False
