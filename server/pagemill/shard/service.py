"""grpc.aio implementation of pagemill.v1.TextGenerationService.

Registered by hand with a generic handler, so only protoc's plain message
module is needed. One model call runs at a time (an asyncio.Lock around
every call that touches the model or the request state). The shard process
runs them in place on its event loop, the thread that loaded the model
(inline); otherwise on one model thread (new_model_thread).

Step semantics (the proto comments are the contract; shard/requests.py checks):
- finished_ids are dropped first; unknown ids are ignored.
- An entry with new_request (re)creates the request's state; any other entry
  must name a request the shard holds, with its num_computed, or it alone
  fails (Generation.error) and is dropped.
- One Generation per scheduled request, in order.
- A rejected call (any non-OK status) leaves the shard's state as it was.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc

from pagemill.proto import SERVICE_NAME, pb
from pagemill.shard.model_runner import ModelRunner
from pagemill.shard.errors import ShardError

log = logging.getLogger(__name__)


def new_model_thread() -> ThreadPoolExecutor:
    """The one thread a shard runs its model on: loading, warmup and every step.

    Why one, and the same one that loaded the model: on the CPU each thread
    that runs torch ops becomes the master of its own OpenMP team, and a
    second team slows every parallel region of the first (measured: a
    [1, 49152] logsumexp 45 us on the loading thread, 250-300 us on another
    thread once the loading thread had a team). With asyncio.to_thread
    consecutive steps also alternated between two pool threads, so four
    threads were busy on two cores: batch-1 decode took 26 ms per step in the
    server against 18.6 ms in the shard sweep.
    """
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="pagemill-model")


class ShardService:
    def __init__(self, runner: ModelRunner, model_thread: ThreadPoolExecutor | None = None, *,
                 inline: bool = False) -> None:  # fmt: skip
        """inline: the event loop runs on the thread that loaded the model, so model calls run
        in place: handing each step to a model thread and its result back wakes two threads
        per step, ~150 us of a batch-1 step (docs/cpu.md). But nothing else is answered while
        a step runs, Health included, and the router takes a step without a Health answer
        for 12 s as a hung shard (recover.rs): a long prefill of a larger model on a CPU is
        that long. So serve (shard/main.py) does not run inline; benchmarks compare both."""
        self.runner = runner
        self.lock = asyncio.Lock()
        # Every model call runs on this one thread (see new_model_thread()), or in place.
        self.model_thread = None if inline else model_thread or new_model_thread()
        # Steps waiting for the model thread (request, future), in arrival order, under
        # _steps_lock (the model thread takes them); how many are queued or running; and the
        # step_id of the last step run, which a step sent ahead names as its after_step_id.
        self._steps: list[tuple] = []
        self._steps_lock = threading.Lock()
        self._stepping = 0
        self._last_step_id = 0

    async def _on_model_thread(self, fn, *args):
        if self.model_thread is None:
            return fn(*args)
        return await asyncio.get_running_loop().run_in_executor(self.model_thread, functools.partial(fn, *args))

    # --- RPCs ------------------------------------------------------------------------

    async def Info(self, request, context):
        return self.runner.info()

    async def Health(self, request, context):
        if (self.lock.locked() or self._stepping) and self.model_thread is not None:
            # A step (or warmup) holds the model thread, maybe for a long while: this loop
            # answering is the sign of life the router's step watch asks for (recover.rs).
            # The device check waits for a moment when the model thread is free.
            self.runner.check_not_broken()
        else:
            await self._on_model_thread(self.runner.health)
        return pb.HealthResponse()

    async def Warmup(self, request, context):
        async with self.lock:
            return await self._on_model_thread(self.runner.warmup, request)

    async def Step(self, request, context):
        start = time.perf_counter_ns()
        if self.model_thread is None:
            async with self.lock:
                result = self.runner.step(request)
        else:
            result = await self._queued_step(request)
        resp = pb.StepResponse(generations=result.generations, forward_ns=result.forward_ns)
        if result.tier is not None:
            t = result.tier
            resp.kv_failed_loads.extend(t.failed_loads)
            resp.kv_lost.extend(t.lost)
            resp.kv_load_ns, resp.kv_save_ns = t.load_ns, t.save_ns
        resp.total_ns = time.perf_counter_ns() - start
        return resp

    async def _queued_step(self, request):
        """The step, run by the model thread. A router that sends the next step before this
        one's reply (scheduler/ahead.rs) finds it queued here: the model thread starts it as
        soon as this one ends, without a turn of the event loop in between, while this loop
        sends the reply. Two calls may reach this point in either order (gRPC reads their
        messages concurrently), so a step naming an after_step_id waits for that step."""
        loop = asyncio.get_running_loop()
        entry = (request, loop.create_future())
        self._stepping += 1
        try:
            # Warmup holds the lock for its whole run: no step slips in beside it.
            async with self.lock:
                with self._steps_lock:
                    self._steps.append(entry)
                self.model_thread.submit(self._drain)
            return await entry[1]
        finally:
            self._stepping -= 1
            with self._steps_lock:  # a call the router gave up on before it ran
                self._steps = [e for e in self._steps if e is not entry]

    def _next_step(self):
        """The oldest queued step whose predecessor (if it names one) has run; None if none."""
        with self._steps_lock:
            for i, (request, _) in enumerate(self._steps):
                if request.after_step_id in (0, self._last_step_id):
                    return self._steps.pop(i)
        return None

    def _drain(self) -> None:
        """On the model thread: every queued step that may run, in order. Each answer goes to
        its own call's event loop: a drain may pick up a step queued after the one that
        submitted it, from another loop (a caller that runs each call in its own loop)."""
        while (entry := self._next_step()) is not None:
            request, done = entry
            self._last_step_id = request.step_id
            try:
                result, error = self.runner.step(request), None
            except BaseException as e:  # the step's own error, answered by its call
                result, error = None, e
            try:
                done.get_loop().call_soon_threadsafe(_settle, done, result, error)
            except RuntimeError:  # that call's loop has closed: nobody waits for the answer
                pass

    # --- registration ----------------------------------------------------------------

    def generic_handler(self) -> grpc.GenericRpcHandler:
        rpcs = {
            "Info": (pb.InfoRequest, pb.InfoResponse),
            "Health": (pb.HealthRequest, pb.HealthResponse),
            "Warmup": (pb.WarmupRequest, pb.WarmupResponse),
            "Step": (pb.StepRequest, pb.StepResponse),
        }
        handlers = {
            name: grpc.unary_unary_rpc_method_handler(
                _with_status(name, getattr(self, name)),
                request_deserializer=req.FromString,
                response_serializer=resp.SerializeToString,
            )
            for name, (req, resp) in rpcs.items()
        }
        return grpc.method_handlers_generic_handler(SERVICE_NAME, handlers)


def _settle(done: asyncio.Future, result, error: BaseException | None) -> None:
    if done.cancelled():  # the router gave up on the call; the step ran all the same
        return
    if error is not None:
        done.set_exception(error)
    else:
        done.set_result(result)


def _with_status(name: str, method):
    """Turns ShardError into its status and any other exception into INTERNAL."""

    async def handler(request, context):
        try:
            return await method(request, context)
        except ShardError as e:
            log.warning("%s rejected: %s %s", name, e.code.name, e.message)
            code, message = e.code, e.message
        except Exception as e:  # never let a bug take the shard down
            log.exception("%s failed", name)
            code, message = grpc.StatusCode.INTERNAL, f"{name} failed: {type(e).__name__}: {e}"
        await context.abort(code, message)

    return handler
