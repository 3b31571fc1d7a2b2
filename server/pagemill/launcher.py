"""`pagemill launch`: start the shards, wait for them, run the router, and
stop everything in order (router drains first, then shards) on a signal.
A child that dies takes the whole server down with a readable message."""

from __future__ import annotations

import argparse
import collections
import ctypes
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass, field, replace
from pathlib import Path

from pagemill.cli import shard_config
from pagemill.config import check_gguf, check_quantize
from pagemill.models.impl import choose_impl
from pagemill.models.auto_dtype import resolve_dtype
from pagemill.options import ROUTER_OPTIONS, dataclass_argv, flag_value, router_argv, router_env
from pagemill.shard.cpu_pinning import allowed_cores, explicit_cores, launch_slices

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    # A launcher killed with SIGKILL must not leave shards holding memory.
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass


@dataclass
class Child:
    name: str
    proc: subprocess.Popen
    tail: collections.deque = field(default_factory=lambda: collections.deque(maxlen=40))

    def pump(self) -> None:
        """Forwards the child's output with a prefix and keeps the last lines."""
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            line = raw.decode(errors="replace").rstrip()
            self.tail.append(line)
            print(f"[{self.name}] {line}", file=sys.stderr, flush=True)


def _spawn(name: str, argv: list[str], env: dict[str, str]) -> Child:
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
                            start_new_session=True, preexec_fn=_die_with_parent)
    child = Child(name, proc)
    threading.Thread(target=child.pump, daemon=True).start()
    return child


def _progress(msg: str, final: bool = False) -> None:
    """One rewritten line on a terminal; plain lines (every 10 s at most) in logs."""
    if sys.stderr.isatty():
        print(f"\r\033[K{msg}", end="\n" if final else "", file=sys.stderr, flush=True)
        return
    now = time.monotonic()
    if final or now - _progress.last >= 10:
        _progress.last = now
        print(msg, file=sys.stderr, flush=True)


_progress.last = 0.0


def _shard_healthy(uds_path: str) -> bool:
    import grpc

    from pagemill.proto import generate_pb2 as pb

    if not os.path.exists(uds_path):
        return False
    with grpc.insecure_channel(f"unix://{uds_path}") as ch:
        health = ch.unary_unary("/pagemill.v1.TextGenerationService/Health",
                                request_serializer=pb.HealthRequest.SerializeToString,
                                response_deserializer=pb.HealthResponse.FromString)
        try:
            health(pb.HealthRequest(), timeout=2)
            return True
        except grpc.RpcError:
            return False


def _threads_per_shard(a: argparse.Namespace) -> int:
    """CPU shards split the cores between them: each torch process otherwise
    starts one thread per core, and N of them oversubscribe the machine while
    they wait on each other at every collective (or, across data-parallel
    groups, at every step)."""
    processes = a.num_shard * a.data_parallel
    if a.num_threads > 0 or a.device != "cpu" or processes == 1:
        return a.num_threads
    return max(1, (os.cpu_count() or 1) // processes)


def _cpu_binds(a: argparse.Namespace, threads: int) -> list[str]:
    """Each shard process's --cpu-bind: several CPU shards on this host get disjoint cores
    (shard/cpu_pinning.py), each `threads` of them."""
    processes = a.num_shard * a.data_parallel
    allowed = allowed_cores()
    if a.device != "cpu" or allowed is None:
        return [a.cpu_bind] * processes
    if a.cpu_bind not in ("auto", "none"):
        explicit_cores(a.cpu_bind, allowed)  # a bad list fails now, not in every shard after it starts
    return launch_slices(a.cpu_bind, allowed, processes, threads)


def _router_healthy(host: str, port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://{host}:{port}/health", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


class Launcher:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.children: list[Child] = []
        self.stopping = threading.Event()
        self.router: dict = {}  # the router's parsed config (RouterConfig's fields), once checked
        self.shard_argv: dict[str, tuple[list[str], dict[str, str], int]] = {}  # name -> (argv, env, group)

    def _fail(self, child: Child) -> int:
        print(f"\npagemill: {child.name} exited with code {child.proc.returncode}; last lines:", file=sys.stderr)
        for line in child.tail:
            print(f"  {line}", file=sys.stderr)
        self.stop()
        return 1

    def _dead(self) -> Child | None:
        return next((c for c in self.children if c.proc.poll() is not None), None)

    def _wait(self, what: str, ready) -> Child | None:
        """Polls `ready` with a progress line; returns a child that died meanwhile."""
        start = time.monotonic()
        while not ready():
            if (dead := self._dead()) is not None:
                return dead
            if self.stopping.is_set():
                return None
            _progress(f"pagemill: {what} ({time.monotonic() - start:.0f}s)")
            time.sleep(0.5)
        _progress(f"pagemill: {what}: done in {time.monotonic() - start:.1f}s", final=True)
        return None

    def run(self) -> int:
        from pagemill.models.default_model import resolve_model

        a = self.args
        _progress("pagemill: resolving model (the default model is converted once, a .gguf's tokenizer and config "
                  "extracted once, then cached)")
        cache_dir = Path(a.cache_dir) if a.cache_dir else None
        model_dir = str(resolve_model(a.model, cache_dir=cache_dir))
        _progress(f"pagemill: model {model_dir}", final=True)
        # Resolved once here so that every shard runs the same dtype (each logs it too).
        dtype, why = resolve_dtype(a.dtype, a.device)
        _progress(f"pagemill: dtype {dtype} ({why})", final=True)
        sock_dir = tempfile.mkdtemp(prefix="pagemill-")
        if a.num_shard < 1:
            raise ValueError(f"--num-shard must be >= 1, got {a.num_shard}")
        if a.data_parallel < 1:
            raise ValueError(f"--data-parallel must be >= 1, got {a.data_parallel}")
        groups = [[os.path.join(sock_dir, f"shard-{g}-{r}.sock" if a.data_parallel > 1 else f"shard-{r}.sock")
                   for r in range(a.num_shard)] for g in range(a.data_parallel)]
        socks = [s for group in groups for s in group]
        from pagemill.models.gguf.extract import gguf_source

        if gguf_source(model_dir) is not None:  # weights read from a GGUF file (models/gguf/load.py)
            check_gguf(a.gguf_weights, a.num_shard, a.quantize)
        check_quantize(a.quantize, a.device.split(":")[0], a.num_shard)  # before any shard loads
        impl = choose_impl(model_dir, a.model_impl, a.num_shard, a.quantize)  # raises naming the architecture
        _progress(f"pagemill: {impl.architecture}: {impl.impl} implementation ({impl.why})", final=True)
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        router_flags, router_vars = self._router_args(model_dir, groups)
        threads = _threads_per_shard(a)
        binds = _cpu_binds(a, threads)
        draft = str(resolve_model(a.draft_model, cache_dir=cache_dir)) if a.draft_model else None  # a .gguf too

        for g, group in enumerate(groups):
            for rank, sock in enumerate(group):
                # torch.distributed's environment for a single-node group (the flags say the same;
                # the env is what libraries inside the shard, e.g. NCCL, look at). Each data-parallel
                # group rendezvouses on its own port.
                port = a.master_port + g
                shard_env = dict(env, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(a.num_shard),
                                 MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
                cfg = replace(shard_config(a, model_dir, sock, rank, a.num_shard), master_addr="127.0.0.1",
                              master_port=port, local_rank=rank, dtype=dtype, num_threads=threads,
                              draft_model=draft, cpu_bind=binds[g * a.num_shard + rank])
                argv = [sys.executable, "-m", "pagemill", "shard", *dataclass_argv(cfg)]
                name = f"shard {rank}" if a.data_parallel == 1 else f"shard {g}.{rank}"
                self.shard_argv[name] = (argv, shard_env, g)
                self.children.append(_spawn(name, argv, shard_env))
        dead = self._wait(f"loading model on {len(socks)} shard(s)",
                          lambda: all(_shard_healthy(s) for s in socks))
        if dead is not None:
            return self._fail(dead)

        argv = [sys.executable, "-m", "pagemill", "router", *router_flags]
        self.children.append(_spawn("router", argv, dict(env, **router_vars)))
        host, port = self.router["hostname"], self.router["port"]
        dead = self._wait("warming up and starting the router", lambda: _router_healthy(host, port))
        if dead is not None:
            return self._fail(dead)
        if self.stopping.is_set():
            self.stop()
            return 0
        print(f"pagemill: ready on http://{host}:{port}", file=sys.stderr, flush=True)

        while not self.stopping.wait(0.2):
            if (dead := self._dead()) is not None:
                if dead.name == "router" or a.data_parallel == 1:
                    return self._fail(dead)
                self._restart_group(self.shard_argv[dead.name][2])
        self.stop()
        return 0

    def _restart_group(self, g: int) -> None:
        """A shard of data-parallel group `g` died: the router has taken the group out of
        rotation and moved its requests; restart every rank of the group (a tensor-parallel
        group cannot lose one rank and go on), and the router re-admits it once it answers."""
        names = {n for n, (_, _, grp) in self.shard_argv.items() if grp == g}
        print(f"\npagemill: a shard of group {g} exited; restarting the group", file=sys.stderr, flush=True)
        for c in [c for c in self.children if c.name in names]:
            if c.proc.poll() is None:
                c.proc.terminate()
                try:
                    c.proc.wait(10)
                except subprocess.TimeoutExpired:
                    c.proc.kill()
                    c.proc.wait()
            self.children.remove(c)
        for name in sorted(names):
            argv, shard_env, _ = self.shard_argv[name]
            self.children.append(_spawn(name, argv, shard_env))

    def _router_args(self, model_dir: str, groups: list[list[str]]) -> tuple[list[str], dict[str, str]]:
        """`pagemill router`'s flags and environment: the router options given to launch plus
        those the launcher sets. Parsed and checked by the router's own parser here, so that a bad
        one fails now rather than after the shards have loaded."""
        from pagemill import _router

        a = self.args
        own = [*flag_value("--tokenizer-dir", model_dir), *flag_value("--model-id", a.model_id or Path(model_dir).name)]
        if len(groups) == 1:
            for s in groups[0]:
                own += flag_value("--shard-uds-path", s)
        else:
            for group in groups:
                own += flag_value("--shard-group", ",".join(group))
        given = getattr(a, ROUTER_OPTIONS)
        argv, env = router_env(given)
        secret = router_argv([(row, v) for row, v in given if row["env"]])
        self.router = _router.parse(["pagemill router", *own, *argv, *secret])
        return own + argv, env

    def stop(self) -> None:
        """Router first (it drains in-flight requests), then the shards."""
        router = [c for c in self.children if c.name == "router"]
        shards = [c for c in self.children if c.name != "router"]
        drain = self.router.get("shutdown_timeout_s", 0) + 10
        for group, timeout in ((router, drain), (shards, 15)):
            for c in group:
                if c.proc.poll() is None:
                    c.proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + timeout
            for c in group:
                try:
                    c.proc.wait(max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    c.proc.kill()
                    c.proc.wait()


def launch(args: argparse.Namespace) -> int:
    launcher = Launcher(args)

    def on_signal(signum, _frame):
        # Stop first: the message is a courtesy. A handler that runs while this
        # thread is itself writing to stderr gets "reentrant call" from print,
        # which must not cost the shutdown (seen as a launcher that ignored SIGTERM).
        launcher.stopping.set()
        try:
            print(f"\npagemill: received {signal.Signals(signum).name}, shutting down", file=sys.stderr, flush=True)
        except (RuntimeError, OSError, ValueError):
            pass

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    try:
        return launcher.run()
    except (ValueError, RuntimeError, FileNotFoundError, ImportError) as e:
        print(f"\npagemill: {str(e).rstrip()}", file=sys.stderr)
        launcher.stop()
        return 1
