"""Starts the real system (`pagemill launch`) in a subprocess for tests."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import httpx


# A request that must still be running seconds later (to fill a batch, to be
# killed, cut by a drain or held past a queue timeout) asks for far more tokens
# than any test waits for, and the test ends it. The tiny model decodes ~700
# tokens/s per sequence with the fused CPU kernels, so the 1,500 tokens these
# tests once asked for ended within the windows they checked.
HOLD_TOKENS = 30000
# Servers that run such requests: the tiny model's context fits them.
HOLD_ARGS = ("--max-total-tokens", "32768")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    proc: subprocess.Popen
    port: int
    log: deque = field(default_factory=lambda: deque(maxlen=400))

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def info(self) -> dict:
        return httpx.get(f"{self.url}/info", timeout=10).json()

    def metric(self, name: str) -> float:
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        for line in text.splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
        raise KeyError(name)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 90) -> int:
        """The launcher's exit code. Its own stop allows the router's drain
        (--shutdown-timeout, 30 s) + 10 s, then the shards 15 s; past `timeout`
        the whole tree is killed and the test fails with the last log lines."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self._kill_tree()
            tail = "\n".join(list(self.log)[-80:])
            raise AssertionError(f"the server did not exit within {timeout:.0f} s of signal {sig}; its last "
                                 f"log lines:\n{tail}") from None

    def _kill_tree(self) -> None:
        import psutil

        try:
            procs = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            procs = []
        for p in [*procs, self.proc]:
            try:
                p.kill()
            except (psutil.NoSuchProcess, ProcessLookupError):
                pass
        self.proc.wait(10)

    def logs(self) -> str:
        return "\n".join(self.log)


def launch(model: str, *extra: str, timeout: float = 300, env: dict | None = None) -> Server:
    port = free_port()
    # float32 unless a test asks: the tests compare against transformers float32 and
    # snapshots, and `--dtype auto` (the default) picks bf16 on CPUs with AVX512-BF16/AMX.
    dtype = () if "--dtype" in extra else ("--dtype", "float32")
    argv = [sys.executable, "-m", "pagemill", "launch", "--model", model, "--port", str(port),
            "--master-port", str(free_port()), *dtype, *extra]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            env=dict(os.environ, **(env or {})))
    server = Server(proc, port)

    def pump():
        for raw in proc.stdout:
            server.log.append(raw.decode(errors="replace").rstrip())

    threading.Thread(target=pump, daemon=True).start()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"launcher exited with {proc.returncode}:\n{server.logs()}")
        try:
            if httpx.get(f"{server.url}/health", timeout=2).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    server.stop(signal.SIGKILL)
    raise TimeoutError(f"server not ready after {timeout}s:\n{server.logs()}")


def error_code(body: dict) -> str:
    """TGI's `error_type`, or `error.code` of the OpenAI routes' error shape (the same names)."""
    return body["error"]["code"] if isinstance(body.get("error"), dict) else body["error_type"]


def error_message(body: dict) -> str:
    """The error text of either shape (TGI's `error`, OpenAI's `error.message`)."""
    return body["error"]["message"] if isinstance(body.get("error"), dict) else body["error"]


def sse_events(response: httpx.Response):
    """Parses `data:` lines of a TGI SSE stream into dicts."""
    for line in response.iter_lines():
        if line.startswith("data:"):
            yield json.loads(line[5:].strip())
