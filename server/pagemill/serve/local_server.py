"""One `pagemill launch` on this node, on free ports, for a framework that runs a
server per replica (Ray Serve): started and waited for, watched, stopped with its
whole process tree. It also dies with the process that started it (PR_SET_PDEATHSIG),
so a replica that is killed leaves no server behind."""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass

PR_SET_PDEATHSIG = 1


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    """In the child, before exec: SIGTERM when the parent thread exits (Linux)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass


@dataclass
class LocalServer:
    proc: subprocess.Popen
    port: int

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        """The launcher's pid (its shards and router are its children)."""
        return self.proc.pid

    @classmethod
    def start(cls, model: str, args: list[str] | tuple[str, ...] = (), timeout: float = 900) -> "LocalServer":
        port = free_port()
        argv = [sys.executable, "-m", "pagemill", "launch", "--model", model, "--hostname", "127.0.0.1",
                "--port", str(port), "--master-port", str(free_port()), *args]
        proc = subprocess.Popen(argv, start_new_session=True, preexec_fn=_die_with_parent)
        server = cls(proc, port)
        server.wait_ready(timeout)
        return server

    def alive(self) -> bool:
        return self.proc.poll() is None

    def healthy(self, timeout: float = 5) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=timeout) as r:
                return r.status == 200
        except OSError:
            return False

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.alive():
                raise RuntimeError(f"pagemill launch exited with {self.proc.returncode} before it was ready")
            if self.healthy(timeout=2):
                return
            time.sleep(0.5)
        self.stop()
        raise TimeoutError(f"pagemill launch not ready after {timeout:.0f} s")

    def stop(self, timeout: float = 60) -> None:
        """SIGTERM to the launcher's process group (it drains, then stops its shards); SIGKILL past `timeout`."""
        if not self.alive():
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        except ProcessLookupError:
            pass
