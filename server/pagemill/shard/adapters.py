"""The runner's side of LoRA adapters (server/pagemill/lora/): the pool a Warmup sizes, and
the adapters attached to the requests of a step on first sight.

Warmup's max_loras / max_lora_rank set the pool; with max_loras > 0 every adaptable linear
gets its LoRA layer and the most the resident adapters can take is set aside from the KV
pool's budget (on the CPU, from --kv-cache-memory; on CUDA, from what the dummy steps leave).
A request whose adapter cannot be served gets the reason as its error and is not computed;
under tensor parallelism the ranks agree on that first (one of them failing to read a file
must not leave the others computing a request it skips: their collectives would not match).
"""

from __future__ import annotations

import logging

import grpc
import torch

from pagemill.lora.adapter import AdapterError
from pagemill.lora.pool import AdapterPool
from pagemill.shard.errors import ShardError
from pagemill.shard.requests import Entry, RequestState

log = logging.getLogger(__name__)


def enable_adapters(runner, req) -> tuple[AdapterPool, int]:
    """(the pool for this WarmupRequest, the bytes set aside for it); ShardError when the
    shard cannot serve adapters as asked."""
    from pagemill.lora.layers import fit_adapter, install, lora_layers, reserved_bytes

    model = runner.model

    def fit(peft, adapter_id: int, name: str):
        return fit_adapter(model, peft, adapter_id, name, runner.dtype, runner.device)

    pool = AdapterPool(req.max_loras, req.max_lora_rank, fit)
    if req.max_loras == 0:
        return pool, 0
    if req.max_lora_rank == 0:
        raise ShardError(grpc.StatusCode.INVALID_ARGUMENT, "max_lora_rank must be > 0 when max_loras > 0")
    if model.impl != "native":
        raise ShardError(grpc.StatusCode.FAILED_PRECONDITION,
                         f"LoRA adapters need pagemill's native model code, not model_impl={model.impl}")  # fmt: skip
    install(model)
    if not lora_layers(model):
        raise ShardError(grpc.StatusCode.FAILED_PRECONDITION, "this model has no linears LoRA adapters apply to")
    reserve = reserved_bytes(model, req.max_loras, req.max_lora_rank, runner.dtype)
    if runner.device.type == "cpu" and reserve >= runner.kv_cache_memory:
        raise ShardError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                         f"{req.max_loras} LoRA adapters of rank {req.max_lora_rank} take up to {reserve} bytes, all "
                         f"of the KV cache memory ({runner.kv_cache_memory} bytes): give it more or lower max_loras / "
                         "max_lora_rank")  # fmt: skip
    log.info("LoRA: up to %d adapters of rank <= %d resident, %.1f MB set aside", req.max_loras, req.max_lora_rank,
             reserve / 1e6)  # fmt: skip
    return pool, reserve


def attach_adapters(pool: AdapterPool, entries: list[Entry], req, held: dict[int, RequestState], group) -> set[int]:
    """Fresh entries that name an adapter get it from the pool (loaded on first sight); those
    that cannot be served get the reason as their error. Returns their ids."""
    asked = [(e, s.new_request.adapter) for e, s in zip(entries, req.requests)
             if e.fresh and e.state is not None and s.new_request.HasField("adapter")]  # fmt: skip
    if not asked:
        return set()
    failed = set()
    for e, adapter in asked:
        in_use = {r.adapter.id for r in held.values() if r.adapter is not None}
        try:
            e.state.adapter = pool.acquire(adapter, in_use)
        except AdapterError as err:
            e.state.error = str(err)
            failed.add(e.id)
        except Exception as err:  # a corrupt file the reader did not foresee: still this request's alone
            log.exception("LoRA adapter %s failed to load", adapter.path)
            e.state.error = f"adapter {adapter.name!r} failed to load: {type(err).__name__}: {err}"
            failed.add(e.id)
    if group.world_size > 1:
        _agree(group, asked, failed)
    return failed


def _agree(group, asked: list, failed: set[int]) -> None:
    """Every rank sees the same step, so all of them reach this collective. A request fails on
    every rank if it failed on any; where the ranks disagreed, all answer the same words (the
    router reads rank 0's; the failing ranks logged their reasons)."""
    where = torch.zeros(len(asked), group.world_size, dtype=torch.int64, device=group.device)
    for i, (e, _) in enumerate(asked):
        where[i, group.rank] = e.id in failed
    where = group.all_reduce(where).tolist()
    for (e, adapter), ranks in zip(asked, where):
        bad = [r for r, n in enumerate(ranks) if n]
        if not bad or len(bad) == group.world_size:
            continue
        if e.id in failed:
            log.warning("LoRA adapter %s failed on this rank, not on every rank: %s", adapter.path, e.state.error)
        e.state.error = f"adapter {adapter.name!r} failed to load on tensor-parallel rank(s) {bad}"
        e.state.adapter = None
        failed.add(e.id)
