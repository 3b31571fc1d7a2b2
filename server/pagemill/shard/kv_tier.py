"""The shard's side of the second KV tier: runs a Step's kv_saves, kv_loads and
kv_deletes against the pool and the store, and tells the router at warmup what
the tier holds and what loading costs against recomputing (docs/kv_cache.md).

Ops run before the step's forward, saves first: the router may have evicted a
block and handed it out again within this same step, so its old content must
be copied out before anything writes it. Loads land in blocks no entry of this
step reads (the router schedules the loading request only after this reply).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import statistics
import time
from dataclasses import dataclass, field

import torch

from pagemill.proto import pb
from pagemill.shard.kv_pool import SCRATCH_BLOCK, KVPool
from pagemill.shard.kv_store import DiskStore, MemoryStore, StoreError

log = logging.getLogger(__name__)


@dataclass
class TierResult:
    failed_loads: list[str] = field(default_factory=list)
    lost: list[str] = field(default_factory=list)
    load_ns: int = 0
    save_ns: int = 0


def namespace(model_dir: str, facts: dict) -> str:
    """What a block's KV depends on besides its tokens: the weights (file names, sizes and
    mtimes, cheap to read; a re-converted model gets new ones), dtypes, block size and this
    rank's layout. Seeds the router's chain hash and is checked in every file header."""
    files = []
    for name in sorted(os.listdir(model_dir)):
        if name.endswith((".safetensors", ".json", ".gguf", ".bin")):
            st = os.stat(os.path.join(model_dir, name))
            files.append((name, st.st_size, st.st_mtime_ns))
    text = json.dumps({"files": files, **facts}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def block_shape(pool: KVPool) -> tuple[int, ...]:
    layers, kv, _, bs, heads, dim = pool.storage.shape
    return (layers, kv, bs, heads, dim)


@dataclass(frozen=True)
class TierOptions:
    """--kv-offload-dir / --kv-offload-disk / --kv-offload-memory, as ShardConfig declares them."""

    directory: str | None = None
    disk_bytes: int = 0
    memory_bytes: int = 0

    @property
    def enabled(self) -> bool:
        return bool(self.directory) or self.memory_bytes > 0


def open_store(opts: TierOptions, pool: KVPool, ns: str, rank: int = 0, world_size: int = 1):
    """The disk store where a directory is given (it persists), else host memory; None
    without either. Tensor-parallel ranks each store their slice, in a folder of their own."""
    shape, dtype = block_shape(pool), pool.storage.dtype
    if opts.directory:
        directory = opts.directory if world_size == 1 else os.path.join(opts.directory, f"rank{rank}")
        return DiskStore(directory, opts.disk_bytes, ns, shape, dtype)
    if opts.memory_bytes > 0:
        return MemoryStore(opts.memory_bytes, shape, dtype, pin=pool.storage.is_cuda)
    return None


def copy_in(pool: KVPool, block_id: int, block: torch.Tensor) -> None:
    """Tier block -> pool block. On the CPU one layer at a time: each copy stays under
    torch's parallel grain, so it runs on this thread alone (a whole block is one
    OpenMP region, and on shared cores its barrier waited ~8 ms for a descheduled
    worker against 0.2 ms for the copy)."""
    if pool.storage.is_cuda:
        pool.storage[:, :, block_id].copy_(block, non_blocking=True)
        return
    for layer in range(pool.storage.shape[0]):
        pool.storage[layer, :, block_id].copy_(block[layer])


def copy_out(pool: KVPool, block_id: int) -> torch.Tensor:
    """Pool block -> a host tensor of its own (pinned for a GPU pool; synchronise before reading)."""
    view = pool.storage[:, :, block_id]
    cuda = pool.storage.is_cuda
    host = torch.empty(view.shape, dtype=view.dtype, pin_memory=cuda)
    if cuda:
        host.copy_(view, non_blocking=True)
        return host
    for layer in range(view.shape[0]):
        host[layer].copy_(view[layer])
    return host


def run_ops(store, pool: KVPool, req) -> TierResult:
    """A StepRequest's tier ops, in contract order: saves, loads, deletes."""
    out = TierResult()
    cuda = pool.storage.is_cuda
    start = time.perf_counter_ns()
    hosts = [copy_out(pool, s.block_id) for s in req.kv_saves]
    if cuda and hosts:
        torch.cuda.current_stream(pool.storage.device).synchronize()  # before the writer thread reads them
    for s, host in zip(req.kv_saves, hosts):
        store.save(s.key, host)
    mid = time.perf_counter_ns()
    for ld in req.kv_loads:
        try:
            block = store.load(ld.key)
        except StoreError:
            out.failed_loads.append(ld.key)
            continue
        copy_in(pool, ld.block_id, block)
    for key in req.kv_deletes:
        store.delete(key)
    store.trim()
    out.lost = store.take_lost()
    out.save_ns, out.load_ns = mid - start, time.perf_counter_ns() - mid
    return out


def measure_load_rate(store, pool: KVPool, probes: int = 8) -> float:
    """Bytes/s of store -> pool copies of freshly written blocks (served from the page
    cache for disk, as recently evicted blocks are), median of `probes` loads."""
    keys = [f"{i:032x}probe" for i in range(probes)]
    for k in keys:
        store.save(k, copy_out(pool, SCRATCH_BLOCK))
    if pool.storage.is_cuda:
        torch.cuda.current_stream(pool.storage.device).synchronize()
    store.flush()
    times = []
    for k in keys:
        t = time.perf_counter_ns()
        try:
            copy_in(pool, SCRATCH_BLOCK, store.load(k))
        except StoreError:
            continue
        if pool.storage.is_cuda:
            torch.cuda.current_stream(pool.storage.device).synchronize()
        times.append(time.perf_counter_ns() - t)
    for k in keys:
        store.delete(k)
    return store.block_bytes / (statistics.median(times) / 1e9) if times else 0.0


def tier_info(store, ns: str, load_bytes_per_s: float, prefill_tokens_per_s: float):
    return pb.KvTier(
        kind=store.kind, namespace=ns, block_bytes=store.block_bytes, capacity_blocks=store.capacity_blocks,
        keys=store.keys(), load_bytes_per_s=load_bytes_per_s, prefill_tokens_per_s=prefill_tokens_per_s,
    )  # fmt: skip


@torch.inference_mode()
def measure_prefill_rate(runner, tokens: int, runs: int = 2) -> float:
    """Prompt tokens/s of one prefill of `tokens` (into the scratch block), median of `runs`:
    what a loaded block saves. Shorter than the prompts it stands for, so if anything
    it overstates the rate (attention grows with length) and favours recomputing."""
    from pagemill.attention.metadata import make_metadata

    bs, dev = runner.block_size, runner.device
    meta = make_metadata(
        is_prefill=True, query_lens=[tokens], kv_lens=[tokens], block_tables=[[SCRATCH_BLOCK] * -(-tokens // bs)],
        slot_mapping=[SCRATCH_BLOCK * bs + i % bs for i in range(tokens)], device=dev,
    )  # fmt: skip
    ids = torch.arange(tokens, device=dev) % runner.config.vocab_size
    positions = torch.arange(tokens, device=dev)
    times = []
    for _ in range(runs):
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        t = time.perf_counter_ns()
        hidden = runner.model(ids, positions, meta, runner.pool.kv_caches)
        runner.model.compute_logits(hidden[-1:])
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        times.append(time.perf_counter_ns() - t)
    return tokens / (statistics.median(times) / 1e9)


def open_tier(runner, req):
    """(store, pb.KvTier) for a runner whose pool warmup just allocated."""
    facts = {"dtype": str(runner.dtype), "kv_dtype": str(runner.kv_dtype), "impl": runner.model.impl,
             "block_size": runner.block_size, "rank": runner.rank, "world_size": runner.world_size,
             # int8 weights change the KV: the module kinds tell quantized from not
             "modules": sorted({type(m).__name__ for m in runner.model.modules()})}  # fmt: skip
    ns = namespace(runner.model_dir, facts) if runner.model_dir else "no-model-dir"
    store = open_store(runner.kv_offload, runner.pool, ns, runner.rank, runner.world_size)
    with torch.inference_mode():
        load_rate = measure_load_rate(store, runner.pool)
        n = max(1, min(256, req.max_batch_prefill_tokens, req.max_input_tokens))
        prefill_rate = measure_prefill_rate(runner, n)
    info = tier_info(store, ns, load_rate, prefill_rate)
    log.info("KV tier (%s): %d of %d blocks stored; load %.0f MB/s, prefill %.0f tokens/s: %.3f vs %.3f ms a block",
             info.kind, len(info.keys), info.capacity_blocks, load_rate / 1e6, prefill_rate,
             info.block_bytes / max(load_rate, 1e-9) * 1e3, runner.block_size / max(prefill_rate, 1e-9) * 1e3)  # fmt: skip
    return store, info
