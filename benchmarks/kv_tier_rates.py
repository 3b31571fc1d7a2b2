"""The two rates the router's load-or-recompute decision compares (docs/kv_cache.md), on
this machine and the default model: disk tier -> pool copy rate (bytes/s: file read,
CRC32 check, copy into the pool) and prefill rate (prompt tokens/s), per block of 16
tokens. Also what the shard measures at warmup, but with more repeats.

    python benchmarks/kv_tier_rates.py --out /tmp/kv-tier-rates/bfloat16-run1

(benchmarks/results/kv-tier-rates/runs.json gathers the committed runs, per dtype.)

Loads are of freshly written files (page cache), as recently evicted blocks are;
--cold drops nothing (that needs root), so a cold-disk rate is not measured here.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import torch

import _repo  # noqa: E402,F401  (the repository from this file's path)


def load_rates(runner, blocks: int) -> dict:
    from pagemill.shard.kv_store import DiskStore
    from pagemill.shard.kv_tier import block_shape, copy_in, copy_out

    pool = runner.pool
    with tempfile.TemporaryDirectory() as d:
        store = DiskStore(d, 1 << 40, "bench", block_shape(pool), pool.storage.dtype)
        keys = [f"{i:032x}" for i in range(blocks)]
        t = time.perf_counter()
        for i, k in enumerate(keys):
            store.save(k, copy_out(pool, 1 + i % (pool.num_blocks - 1)))
        store.flush()
        write_s = (time.perf_counter() - t) / blocks
        times = []
        for i, k in enumerate(keys):
            t = time.perf_counter()
            copy_in(pool, 1 + i % (pool.num_blocks - 1), store.load(k))
            times.append(time.perf_counter() - t)
    per = statistics.median(times)
    return {"block_bytes": store.block_bytes, "load_ms_per_block": per * 1e3,
            "load_bytes_per_s": store.block_bytes / per, "write_ms_per_block": write_s * 1e3}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    ap.add_argument("--blocks", type=int, default=64)
    ap.add_argument("--prefill-tokens", type=int, default=512)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    from pagemill.bench.cli import resolve_model_dir
    from pagemill.bench.shard_driver import warm_runner
    from pagemill.config import ShardConfig
    from pagemill.shard.model_runner import ModelRunner
    from pagemill.shard.kv_tier import measure_prefill_rate

    cfg = ShardConfig(model_dir=resolve_model_dir(None), uds_path="", dtype=a.dtype, kv_cache_memory=256 << 20)
    runner = ModelRunner.from_shard_config(cfg)
    warm_runner(runner, max_batch_size=1, max_prefill_tokens=a.prefill_tokens, max_input=a.prefill_tokens)
    with torch.inference_mode():
        prefill = measure_prefill_rate(runner, a.prefill_tokens, runs=a.runs)
        loads = load_rates(runner, a.blocks)
    bs = runner.block_size
    row = {**loads, "dtype": a.dtype, "prefill_tokens_per_s": prefill,
           "recompute_ms_per_block": bs / prefill * 1e3, "threads": torch.get_num_threads()}  # fmt: skip
    print(f"{'dtype':<9} {'block KiB':>9} {'load ms/blk':>11} {'load MB/s':>9} {'prefill tok/s':>13} "
          f"{'recompute ms/blk':>16}")
    print(f"{a.dtype:<9} {row['block_bytes'] / 1024:>9.0f} {row['load_ms_per_block']:>11.3f} "
          f"{row['load_bytes_per_s'] / 1e6:>9.0f} {prefill:>13.0f} {row['recompute_ms_per_block']:>16.2f}")
    if a.out:
        os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
        with open(a.out + ".json", "w") as f:
            json.dump(row, f, indent=2)


if __name__ == "__main__":
    main()
