"""grpc.aio implementation of pagemill.v1.TextGenerationService.

Registered by hand with a generic handler, so only protoc's plain message
module is needed. One model call runs at a time (an asyncio.Lock around
every call that touches the model or the cached batches); torch work runs
in a worker thread so Info/Health stay responsive during a long prefill.

Semantics the router relies on:
- Prefill caches the batch under its id unless every request finished.
- Decode concatenates the listed cached batches in order, keeps the first
  id and drops the others' ids; requests that finish are removed.
- FilterBatch keeps the listed request ids; an empty list drops the batch.
- ClearCache drops one batch (unknown id: no-op) or all.
- A rejected call (any non-OK status) leaves the cached batches as they were.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from concurrent.futures import ThreadPoolExecutor

import grpc

from pagemill.proto import SERVICE_NAME, pb
from pagemill.shard.batch import ShardBatch
from pagemill.shard.engine import ModelRunner
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
    def __init__(self, runner: ModelRunner, model_thread: ThreadPoolExecutor | None = None) -> None:
        self.runner = runner
        self.batches: dict[int, ShardBatch] = {}
        self.lock = asyncio.Lock()
        # Every model call runs on this one thread (see model_thread()).
        self.model_thread = model_thread or new_model_thread()

    async def _on_model_thread(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self.model_thread, functools.partial(fn, *args))

    # --- RPCs ------------------------------------------------------------------------

    async def Info(self, request, context):
        return self.runner.info()

    async def Health(self, request, context):
        await self._on_model_thread(self.runner.health)
        return pb.HealthResponse()

    async def Warmup(self, request, context):
        async with self.lock:
            self.batches.clear()  # their KV lived in the pool being replaced
            return await self._on_model_thread(self.runner.warmup, request)

    async def Prefill(self, request, context):
        start = time.perf_counter_ns()
        async with self.lock:
            if request.batch.id in self.batches:
                raise ShardError(grpc.StatusCode.ALREADY_EXISTS, f"batch {request.batch.id} is already cached")
            batch = self.runner.new_batch(request.batch)
            result = await self._on_model_thread(self.runner.prefill, batch)
            if batch.requests:
                self.batches[batch.id] = batch
            return pb.PrefillResponse(
                generations=result.generations,
                batch=batch.to_pb() if batch.requests else None,
                forward_ns=result.forward_ns,
                total_ns=time.perf_counter_ns() - start,
            )

    async def Decode(self, request, context):
        start = time.perf_counter_ns()
        async with self.lock:
            ids = [b.id for b in request.batches]
            if not ids:
                raise ShardError(grpc.StatusCode.INVALID_ARGUMENT, "Decode needs at least one batch")
            if len(set(ids)) != len(ids):
                raise ShardError(grpc.StatusCode.INVALID_ARGUMENT, f"batch ids repeat in {ids}")
            for cached in request.batches:
                batch = self._get(cached.id)
                # An empty request_ids list is not checked (the router may omit it).
                if cached.request_ids and set(cached.request_ids) != {r.id for r in batch.requests}:
                    raise ShardError(
                        grpc.StatusCode.INVALID_ARGUMENT,
                        f"batch {cached.id}: router lists requests {sorted(cached.request_ids)}, "
                        f"shard holds {sorted(r.id for r in batch.requests)}",
                    )
            merged = ShardBatch.concatenate([self.batches[i] for i in ids])
            result = await self._on_model_thread(self.runner.decode, merged, request.slots)
            for i in ids:
                del self.batches[i]
            if merged.requests:
                self.batches[merged.id] = merged
            return pb.DecodeResponse(
                generations=result.generations,
                batch=merged.to_pb() if merged.requests else None,
                forward_ns=result.forward_ns,
                total_ns=time.perf_counter_ns() - start,
            )

    async def FilterBatch(self, request, context):
        async with self.lock:
            batch = self._get(request.batch_id).filter(request.request_ids)
            if batch.requests:
                self.batches[batch.id] = batch
            else:
                del self.batches[batch.id]
            return pb.FilterBatchResponse(batch=batch.to_pb())

    async def ClearCache(self, request, context):
        async with self.lock:
            if request.HasField("batch_id"):
                self.batches.pop(request.batch_id, None)
            else:
                self.batches.clear()
            return pb.ClearCacheResponse()

    def _get(self, batch_id: int) -> ShardBatch:
        batch = self.batches.get(batch_id)
        if batch is None:
            raise ShardError(grpc.StatusCode.NOT_FOUND, f"batch {batch_id} is not cached on this shard")
        return batch

    # --- registration ----------------------------------------------------------------

    def generic_handler(self) -> grpc.GenericRpcHandler:
        rpcs = {
            "Info": (pb.InfoRequest, pb.InfoResponse),
            "Health": (pb.HealthRequest, pb.HealthResponse),
            "Warmup": (pb.WarmupRequest, pb.WarmupResponse),
            "Prefill": (pb.PrefillRequest, pb.PrefillResponse),
            "Decode": (pb.DecodeRequest, pb.DecodeResponse),
            "FilterBatch": (pb.FilterBatchRequest, pb.FilterBatchResponse),
            "ClearCache": (pb.ClearCacheRequest, pb.ClearCacheResponse),
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
