"""Decode throughput sweep on the model itself (no HTTP, no scheduler).

For each attention backend and batch size: one prefill of `batch` prompts
(its wall time is the batch's TTFT), then timed greedy decode steps. Each
step reads every weight once and the K/V of every cached token once, so
(weight bytes + KV bytes) / step time, over the GPU's peak HBM bandwidth,
says how close decode is to the memory roofline. Without CUDA graphs a
small model is launch-bound at small batches: a low fraction there is the
honest figure, not a measurement error. --graph-backends repeats the sweep
of those backends with decode replayed from a CUDA graph (shard/cuda_graphs.py,
one graph captured per batch size, inputs copied into its static buffers each
step as the shard does); on CPU that path runs the static-buffer forward eagerly.

Run by scripts/gpu_check.sh (from benchmarks/); runs on CPU too (tests, smoke runs).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass

import torch

import _repo  # noqa: E402,F401  (the repository from this file's path)

H200_HBM_BYTES_PER_S = 4.8e12
BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256)


@dataclass
class Row:
    backend: str
    batch: int
    ttft_ms: float  # prefill of the whole batch
    step_ms: float  # one decode step of the whole batch
    decode_tokens_per_s: float
    hbm_fraction: float
    cuda_graphs: bool = False  # decode replayed from a CUDA graph (eager static buffers on CPU)


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes a decode step reads from weights: all but the embedding, of which it gathers a few rows.

    A tied embedding is the lm_head too and is read whole (parameters() lists it once).
    """
    embed = model.model.embed_tokens.weight
    tied = model.lm_head.weight is embed
    return sum(p.numel() * p.element_size() for p in model.parameters() if tied or p is not embed)


def kv_bytes_per_token(config, dtype: torch.dtype) -> int:
    """K and V of one token over all layers."""
    return 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * dtype.itemsize


def hbm_fraction(bytes_per_step: float, step_s: float, peak_bytes_per_s: float = H200_HBM_BYTES_PER_S) -> float:
    return bytes_per_step / step_s / peak_bytes_per_s


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def measure(model, config, pool, *, backend: str, batch: int, prompt_len: int, steps: int, warmup: int = 2,
            graphs: bool = False) -> Row:  # fmt: skip
    """One prefill then warmup + `steps` timed decode steps of `batch` sequences in `pool`."""
    from pagemill.attention.metadata import make_metadata
    from pagemill.shard.step_inputs import StepInputs
    from pagemill.shard.cuda_graphs import DecodeGraphs

    device, bs = pool.storage.device, pool.block_size
    per_seq = -(-(prompt_len + warmup + steps) // bs)
    tables = [[1 + i * per_seq + j for j in range(per_seq)] for i in range(batch)]  # block 0 is scratch

    def slots(lens: list[int], start: int) -> list[int]:
        return [t[p // bs] * bs + p % bs for t, n in zip(tables, lens) for p in range(start, start + n)]

    ids = torch.randint(0, config.vocab_size, (batch * prompt_len,), device=device)
    meta = make_metadata(is_prefill=True, query_lens=[prompt_len] * batch, kv_lens=[prompt_len] * batch,
                         block_tables=tables, slot_mapping=slots([prompt_len] * batch, 0), device=device)  # fmt: skip
    _sync(device)
    start = time.perf_counter()
    hidden = model(ids, torch.arange(prompt_len, device=device).repeat(batch), meta, pool.kv_caches)
    tokens = model.compute_logits(hidden[prompt_len - 1 :: prompt_len]).argmax(-1)
    _sync(device)
    ttft = time.perf_counter() - start

    decode_graph = None
    if graphs:
        decode_graph = DecodeGraphs(model, pool.kv_caches, max_batch_size=batch, block_size=bs, device=device,
                                    max_total_tokens=per_seq * bs, vocab_size=config.vocab_size, buckets=[batch])
        if device.type == "cuda":
            decode_graph.capture()  # before the timed steps (its warm-up run writes only scratch block 0)
    length, kv_read = prompt_len, 0
    for i in range(warmup + steps):
        if i == warmup:
            _sync(device)
            start, kv_read = time.perf_counter(), 0
        meta = make_metadata(is_prefill=False, query_lens=[1] * batch, kv_lens=[length + 1] * batch,
                             block_tables=tables, slot_mapping=[t[length // bs] * bs + length % bs for t in tables],
                             device=device)  # fmt: skip
        positions = torch.full((batch,), length, device=device)
        if decode_graph is not None:
            tokens = decode_graph.logits_for(StepInputs(tokens, positions, meta, positions)).argmax(-1)
        else:
            tokens = model.compute_logits(model(tokens, positions, meta, pool.kv_caches)).argmax(-1)
        length += 1
        kv_read += batch * length
    _sync(device)
    step = (time.perf_counter() - start) / steps
    step_bytes = weight_bytes(model) + kv_bytes_per_token(config, pool.storage.dtype) * kv_read / steps
    return Row(backend, batch, ttft * 1e3, step * 1e3, batch / step, hbm_fraction(step_bytes, step), graphs)


def sweep(model_dir: str, *, backends, batches, device: str, dtype: str, prompt_len: int, steps: int,
          graph_backends=()) -> list[Row]:  # fmt: skip
    from pagemill.attention.backend import select_backend
    from pagemill.models.loader import load_model, parse_dtype
    from pagemill.shard.kv_pool import KVPool

    rows = []
    model, config = load_model(model_dir, parse_dtype(dtype), device, select_backend("torch", device))
    block_size = 16
    # One pool for the largest batch (plus scratch block 0), reused by every run.
    blocks = 1 + max(batches) * -(-(prompt_len + 2 + steps) // block_size)
    pool = KVPool.with_blocks(config, num_blocks=blocks, block_size=block_size, dtype=parse_dtype(dtype),
                              device=device)  # fmt: skip
    runs = [(name, False) for name in backends] + [(name, True) for name in graph_backends]
    for name, graphs in runs:
        model.set_backend(select_backend(name, device))
        for batch in batches:
            rows.append(measure(model, config, pool, backend=name, batch=batch, prompt_len=prompt_len, steps=steps,
                                graphs=graphs))  # fmt: skip
            print(format_row(rows[-1]), flush=True)
    return rows


HEADER = f"{'backend':8} {'graphs':>6} {'batch':>5} {'TTFT ms':>9} {'step ms':>8} {'decode tok/s':>13} {'HBM %':>7}"


def format_row(r: Row) -> str:
    graphs = "yes" if r.cuda_graphs else "no"
    return (f"{r.backend:8} {graphs:>6} {r.batch:>5} {r.ttft_ms:>9.2f} {r.step_ms:>8.2f} "
            f"{r.decode_tokens_per_s:>13.0f} {100 * r.hbm_fraction:>7.2f}")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="HF model dir (default: the converted default model)")
    p.add_argument("--backends", default="triton", help="comma-separated attention backends")
    p.add_argument("--graph-backends", default="",
                   help="comma-separated backends to sweep again with decode CUDA graphs")
    p.add_argument("--batches", default=",".join(map(str, BATCHES)))
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=32, help="timed decode steps per batch size")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    from pagemill.models.default_model import ensure_default_model

    model_dir = str(a.model or ensure_default_model())
    print(f"sweep: {model_dir} {a.dtype} on {a.device}, prompts of {a.prompt_len}, {a.steps} decode steps; "
          f"HBM % of {H200_HBM_BYTES_PER_S / 1e12:.1f} TB/s")  # fmt: skip
    print(HEADER)
    rows = sweep(model_dir, backends=a.backends.split(","), batches=[int(b) for b in a.batches.split(",")],
                 device=a.device, dtype=a.dtype, prompt_len=a.prompt_len, steps=a.steps,
                 graph_backends=[b for b in a.graph_backends.split(",") if b])  # fmt: skip
    if a.json:
        report = {"model": model_dir, "dtype": a.dtype, "device": a.device, "prompt_len": a.prompt_len,
                  "steps": a.steps, "peak_hbm_bytes_per_s": H200_HBM_BYTES_PER_S, "rows": [asdict(r) for r in rows]}
        with open(a.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
