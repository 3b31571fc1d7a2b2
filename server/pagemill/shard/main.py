"""Shard process entry point: load the model, serve gRPC on a unix socket (or on TCP with a token)."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import stat
from concurrent.futures import ThreadPoolExecutor

import grpc
import torch

from pagemill.config import ShardConfig
from pagemill.parallel.group import ParallelConfig, ParallelGroup, rank_device
from pagemill.shard.malloc_tuning import keep_freed_memory
from pagemill.shard.auth import TokenAuth, read_token
from pagemill.shard.gil import shorten_gil_switch
from pagemill.shard.model_runner import ModelRunner
from pagemill.shard.cpu_pinning import Placement, allowed_cores, pin_team, pin_this_thread, plan_placement
from pagemill.shard.service import ShardService, new_model_thread

log = logging.getLogger("pagemill.shard")

# Steps with long prompts and responses with top-n alternatives can
# exceed gRPC's 4 MiB default.
MAX_MESSAGE_BYTES = 256 << 20
MAX_UDS_PATH = 107  # sockaddr_un.sun_path is 108 bytes on Linux, NUL included


def serve(config: ShardConfig) -> None:
    """Blocks until SIGTERM/SIGINT, then stops the server and removes the socket."""
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not config.uds_path and not config.listen:
        raise ValueError("a shard serves on --uds-path or --listen host:port")
    if config.listen and not config.shard_auth_token_file:
        raise ValueError("--listen (TCP) needs --shard-auth-token-file: the router's calls are authenticated")
    # Read before loading: a missing token file fails in a second, not after the model loads.
    token = read_token(config.shard_auth_token_file) if config.shard_auth_token_file else None
    keep_freed_memory()  # before the first large allocation: steps then reuse their pages
    shorten_gil_switch()  # the model thread waits less for the event loop's thread (gil.py)
    # Rendezvous first (cheap), then load: every rank loads only its slices.
    group = ParallelGroup.init(
        ParallelConfig(
            rank=config.rank, world_size=config.world_size, master_addr=config.master_addr,
            master_port=config.master_port, timeout_s=config.dist_timeout_s,
        ),
        rank_device(config.device, config.rank, config.world_size, config.local_rank),
    )  # fmt: skip
    # Every model call on one thread that also loads the model (service.new_model_thread says
    # why), the event loop on this one: not inline (ShardService), so that Health answers while
    # a long step runs, which is how the router tells a slow step from a hung shard (recover.rs).
    placement = _placement(config)  # before this thread starts any other (they inherit its core)
    model_thread = new_model_thread()
    try:
        runner = model_thread.submit(_load, config, group, placement).result()
        asyncio.run(serve_runner(runner, config.uds_path, model_thread=model_thread, listen=config.listen,
                                 token=token))
    finally:
        group.destroy()
        model_thread.shutdown()


def _load(config: ShardConfig, group: ParallelGroup, placement: Placement | None) -> ModelRunner:
    """Runs on the model thread (service.new_model_thread says why)."""
    if config.num_threads > 0:
        torch.set_num_threads(config.num_threads)
    if placement is not None:  # the team, before its first parallel region anywhere else
        from pagemill.cpu_kernels.build import library

        if pin_team(library(), placement.cores):
            log.info("OpenMP threads pinned to cores %s (--cpu-bind %s)", placement.cores, config.cpu_bind)
        else:
            log.warning("could not pin every OpenMP thread to cores %s", placement.cores)
    return ModelRunner.from_shard_config(config, group)


def _placement(config: ShardConfig) -> Placement | None:
    """shard/cpu_pinning.py's plan for this shard, with this thread already pinned; None: nothing
    pinned (not a CPU shard with compiled kernels, or the plan says why not)."""
    if config.device.split(":")[0] != "cpu":
        return None
    allowed = allowed_cores()
    threads = config.num_threads if config.num_threads > 0 else torch.get_num_threads()
    plan, why = (None, "the OS gives no affinity") if allowed is None else \
        plan_placement(config.cpu_bind, allowed, threads, config.local_rank or 0)  # fmt: skip
    if plan is not None:
        from pagemill.cpu_kernels.build import library

        if not config.cpu_kernels or library() is None:  # built now, on this thread
            plan, why = None, "no compiled CPU kernels to pin the team with"
    if plan is None:
        log.info("threads not pinned to cores: %s", why)
        return None
    pin_this_thread(plan.cores[0])
    return plan


async def serve_runner(runner: ModelRunner, uds_path: str, stop: asyncio.Event | None = None,
                       model_thread: ThreadPoolExecutor | None = None, listen: str | None = None,
                       token: bytes | None = None, inline: bool = False) -> None:  # fmt: skip
    """Serves `runner` on unix://uds_path (or TCP `listen`, host:port) until `stop` is set (or
    a signal arrives). token: every call must carry it (shard/auth.py). model_thread: the
    thread that loaded `runner` (a new one if None). inline: this thread loaded `runner`;
    model calls run on the event loop (ShardService)."""
    if listen:
        address = listen
    else:
        if len(os.fsencode(uds_path)) > MAX_UDS_PATH:
            raise ValueError(f"unix socket path is longer than {MAX_UDS_PATH} bytes: {uds_path}")
        _remove_stale_socket(uds_path)
        address = f"unix://{uds_path}"
    server = grpc.aio.server(
        interceptors=[TokenAuth(token)] if token else None,
        options=[
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ],
    )
    server.add_generic_rpc_handlers((ShardService(runner, model_thread, inline=inline).generic_handler(),))
    if server.add_insecure_port(address) == 0:
        raise OSError(f"cannot listen on {address}")
    await server.start()

    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (RuntimeError, ValueError):  # not the main thread (tests): rely on `stop`
            pass
    info = runner.info()
    log.info(
        "shard %d/%d ready on %s%s: model=%s dtype=%s device=%s attention=%s",
        info.rank, info.world_size, address, " (token required)" if token else "", info.model_id, info.dtype, info.device_type, info.attention_backend,
    )  # fmt: skip
    try:
        await stop.wait()
    finally:
        log.info("shard %d stopping", info.rank)
        await server.stop(grace=1.0)
        if runner.store is not None:
            runner.store.flush()  # blocks saved but not yet written: a restart finds them
        if not listen and os.path.exists(uds_path):
            os.unlink(uds_path)


def _remove_stale_socket(path: str) -> None:
    """A socket file left by a killed shard would make bind() fail."""
    if not os.path.lexists(path):
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        return
    if not stat.S_ISSOCK(os.lstat(path).st_mode):
        raise FileExistsError(f"{path} exists and is not a socket; refusing to replace it")
    os.unlink(path)
