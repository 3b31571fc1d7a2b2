"""fp8 KV cache (--kv-cache-dtype): casts, torch-backend attention accuracy, pool sizing, end to end.

Accuracy is measured against the same attention over a float32 pool holding
the same keys and values, on shuffled block tables with mixed lengths: the
only difference is the fp8 rounding of K and V. Tolerances (max abs error /
max |reference|, with keys/values ~ N(0, 1)): FP8_TOLERANCE below. e4m3 keeps 3
mantissa bits (relative rounding error <= 2**-4 per element), e5m2 keeps 2
(<= 2**-3); attention averages many such errors, hence well under those bounds.
"""

from __future__ import annotations

import random

import pytest
import torch

from conftest import build_model_dir
from pagemill.attention import kv_dtype
from pagemill.attention.kv_dtype import check_kv_dtype, kv_dtype_name, parse_kv_cache_dtype, quantize, write_rows
from pagemill.attention.metadata import make_metadata
from pagemill.attention.torch_backend import TorchAttentionBackend
from pagemill.cpu_kernels.build import build_library
from pagemill.cpu_kernels.decode import DecodeKernels, decode_kernels
from pagemill.models.loader import load_model
from pagemill.proto import pb
from pagemill.shard.model_runner import ModelRunner

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FP8_TOLERANCE = {E4M3: 0.06, E5M2: 0.12}
# Whole tiny model (conftest's random weights, drawn large on purpose, so attention is sharp and
# sensitive): measured 0.076 (e4m3) and 0.158 (e5m2) on CPU; the bounds leave ~1.5x of margin.
FP8_LOGIT_TOLERANCE = {"fp8_e4m3": 0.12, "fp8_e5m2": 0.25}
BLOCK_SIZE, KV_HEADS, HEAD_DIM = 16, 2, 64


def test_parse_and_names():
    assert parse_kv_cache_dtype("auto", torch.bfloat16) is torch.bfloat16
    assert parse_kv_cache_dtype("fp8_e4m3", torch.bfloat16) is E4M3
    assert parse_kv_cache_dtype("fp8_e5m2", torch.float32) is E5M2
    assert [kv_dtype_name(d) for d in (E4M3, E5M2, torch.bfloat16)] == ["fp8_e4m3", "fp8_e5m2", "bfloat16"]
    with pytest.raises(ValueError, match="unknown kv cache dtype 'int4'"):
        parse_kv_cache_dtype("int4", torch.float32)


def test_writes_saturate_and_round_trip():
    x = torch.tensor([[1000.0, -1000.0, 0.3, 1e-3]])
    # Clamped, not NaN; 1e-3 rounds to the smallest subnormal.
    assert quantize(x, E4M3).float().tolist() == [[448.0, -448.0, 0.3125, 2**-9]]
    assert quantize(x, E5M2).float()[0, :2].tolist() == [1024.0, -1024.0]  # within e5m2's range: rounded
    assert torch.isfinite(quantize(torch.tensor([1e6]), E5M2).float()).all()  # beyond it: clamped, not inf
    # Slot writes (CPU has no fp8 index_copy_: a uint8 view) hit exactly the given rows.
    rows = torch.zeros(6, 2, 4, dtype=E4M3)
    new = torch.randn(2, 2, 4)
    write_rows(rows, torch.tensor([4, 1]), new)
    assert torch.equal(rows[4].float(), new[0].to(E4M3).float())
    assert torch.equal(rows[1].float(), new[1].to(E4M3).float())
    assert rows[[0, 2, 3, 5]].float().abs().sum() == 0


def _pools(dtype, num_blocks=64):
    shape = (num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    return [torch.zeros(shape, dtype=d) for d in (torch.float32, torch.float32, dtype, dtype)]


def _case(dtype, shapes, seed=0):
    """Writes (cached + new) keys per sequence into an fp32 and an fp8 pool via shuffled tables."""
    g = torch.Generator().manual_seed(seed)
    free = list(range(1, 64))
    random.Random(seed).shuffle(free)
    k32, v32, k8, v8 = _pools(dtype)
    backend = TorchAttentionBackend()
    tables, slots, qs, ks, vs = [], [], [], [], []
    heads = KV_HEADS * 3  # GQA 3
    for cached, n in shapes:
        total = cached + n
        table = [free.pop() for _ in range(-(-total // BLOCK_SIZE))]
        seq_slots = [table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(total)]
        k, v = torch.randn(total, KV_HEADS, HEAD_DIM, generator=g), torch.randn(total, KV_HEADS, HEAD_DIM, generator=g)
        s = torch.tensor(seq_slots)
        backend.write_kv(k, v, k32, v32, s)
        backend.write_kv(k, v, k8, v8, s)
        tables.append(table), slots.extend(seq_slots[cached:])
        qs.append(torch.randn(n, heads, HEAD_DIM, generator=g)), ks.append(k[cached:]), vs.append(v[cached:])
    meta = make_metadata(is_prefill=any(n > 1 for _, n in shapes), query_lens=[n for _, n in shapes],
                         kv_lens=[c + n for c, n in shapes], block_tables=tables, slot_mapping=slots,
                         device="cpu")  # fmt: skip
    return torch.cat(qs), torch.cat(ks), torch.cat(vs), (k32, v32), (k8, v8), meta


def _rel(out, ref):
    return ((out - ref).abs().max() / ref.abs().max()).item()


@pytest.mark.parametrize("dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_fp8_decode_and_prefill_match_full_precision(dtype):
    backend, scale = TorchAttentionBackend(), HEAD_DIM**-0.5
    errors = {}
    # Decode: one new token per sequence, mixed context lengths (1 .. 5 blocks, ragged tails).
    q, _, _, full, fp8, meta = _case(dtype, [(c, 1) for c in (0, 6, 31, 47, 80)])
    ref = backend.decode(q, *full, meta, scale)
    out = backend.decode(q, *fp8, meta, scale)
    assert out.dtype == torch.float32 and torch.isfinite(out).all()
    errors["decode"] = _rel(out, ref)
    kernels = decode_kernels()
    # The compiled kernel widens fp8 exactly too (float rounding apart), and so does its portable build.
    builds = [] if kernels is None else [kernels, DecodeKernels(build_library(("-mno-avx512f",)))]
    for kernels in builds:
        for q_dtype in (torch.float32, torch.bfloat16):
            fast = TorchAttentionBackend(kernels).decode(q.to(q_dtype), *fp8, meta, scale)
            assert fast.dtype == q_dtype
            slow = backend.decode(q.to(q_dtype).float(), *fp8, meta, scale)
            torch.testing.assert_close(fast.float(), slow, rtol=1e-5 if q_dtype == torch.float32 else 2**-7,
                                       atol=1e-5 if q_dtype == torch.float32 else 1e-2)  # fmt: skip
    # Prefill with cached prefixes: the prefix is read back from the fp8 pool.
    q, k, v, full, fp8, meta = _case(dtype, [(20, 5), (33, 12), (0, 9)], seed=1)
    ref = backend.prefill(q, k, v, *full, meta, scale)
    out = backend.prefill(q, k, v, *fp8, meta, scale)
    errors["prefill"] = _rel(out, ref)
    print(kv_dtype_name(dtype), {n: round(e, 4) for n, e in errors.items()})
    assert 0 < max(errors.values()) < FP8_TOLERANCE[dtype], errors


def test_check_rejects_e4m3_on_triton_before_ada(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    with pytest.raises(ValueError, match=r"fp8_e4m3 with the triton attention backend needs .* >= 8\.9.* 8\.0"):
        check_kv_dtype(E4M3, "triton", "cuda")
    with pytest.raises(ValueError, match="flash attention backend"):
        check_kv_dtype(E4M3, "flash", "cuda")
    check_kv_dtype(E5M2, "triton", "cuda")  # Triton has float8e5 on Ampere
    check_kv_dtype(E4M3, "torch", "cuda")  # torch casts on any GPU
    check_kv_dtype(E4M3, "torch", "cpu")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    check_kv_dtype(E4M3, "triton", "cuda")


# --- end to end on a tiny model ------------------------------------------------------------

TINY_BLOCK = 4
WARMUP = pb.WarmupRequest(max_batch_prefill_tokens=64, max_input_tokens=32, max_total_tokens=96, max_batch_size=4)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return build_model_dir(str(tmp_path_factory.mktemp("fp8") / "m"), "llama_gqa")


def _runner(model_dir, dtype, kv_cache_dtype, memory=1 << 20):
    model, config = load_model(model_dir, dtype)
    runner = ModelRunner(model, config, block_size=TINY_BLOCK, kv_cache_memory=memory, kv_cache_dtype=kv_cache_dtype)
    runner.warmup(WARMUP)
    return runner


def _greedy(runner, prompts, max_new):
    from test_speculative import generate

    out = generate(runner, prompts, max_new)
    return [out[i].ids for i in range(len(prompts))]


@pytest.mark.parametrize("model_dtype, factor", [(torch.bfloat16, 2), (torch.float32, 4)])
def test_fp8_pool_holds_more_blocks_and_generates(tiny_dir, model_dtype, factor):
    base = _runner(tiny_dir, model_dtype, "auto")
    fp8 = _runner(tiny_dir, model_dtype, "fp8_e4m3")
    assert base.pool.storage.dtype == model_dtype and fp8.pool.storage.dtype == E4M3
    print(f"{model_dtype}: {base.pool.num_blocks} blocks; fp8_e4m3: {fp8.pool.num_blocks} blocks (1 MiB)")
    assert fp8.pool.num_blocks == factor * base.pool.num_blocks
    assert fp8.info().kv_cache_dtype == "fp8_e4m3" and base.info().kv_cache_dtype == kv_dtype_name(model_dtype)
    prompts = [[5, 17, 99, 42, 7, 250, 3, 8, 11], [60, 61, 62], [1, 200, 13, 14, 15, 16, 17]]
    ref, got = _greedy(base, prompts, 24), _greedy(fp8, prompts, 24)
    assert all(len(t) == 24 for t in got)
    same = sum(a == b for r, g in zip(ref, got) for a, b in zip(r, g))
    print(f"greedy tokens equal to the {model_dtype} KV run: {same}/{24 * len(prompts)}")
    # The first token comes from prefill, which attends to the fresh full-precision k/v.
    assert [t[0] for t in got] == [t[0] for t in ref]


@torch.inference_mode()
def _teacher_forced_logits(runner, tokens, fresh):
    """Prefill tokens[:fresh], then decode the rest one by one (blocks 1, 2, ...): each step's logits."""
    model, bs, dev = runner.model, TINY_BLOCK, runner.device
    table = list(range(1, 1 + -(-len(tokens) // bs)))
    slot = lambda p: table[p // bs] * bs + p % bs  # noqa: E731
    meta = make_metadata(is_prefill=True, query_lens=[fresh], kv_lens=[fresh], block_tables=[table],
                         slot_mapping=[slot(p) for p in range(fresh)], device=dev)  # fmt: skip
    model(torch.tensor(tokens[:fresh]), torch.arange(fresh), meta, runner.pool.kv_caches)
    logits = []
    for p in range(fresh, len(tokens)):
        meta = make_metadata(is_prefill=False, query_lens=[1], kv_lens=[p + 1], block_tables=[table],
                             slot_mapping=[slot(p)], device=dev)  # fmt: skip
        hidden = model(torch.tensor([tokens[p]]), torch.tensor([p]), meta, runner.pool.kv_caches)
        logits.append(model.compute_logits(hidden)[0])
    return torch.stack(logits)


@pytest.mark.parametrize("kv", ["fp8_e4m3", "fp8_e5m2"])
def test_fp8_decode_logits_track_full_precision(tiny_dir, kv):
    """Same tokens, decode steps reading an fp8 vs a float32 pool: logits within FP8_LOGIT_TOLERANCE."""
    tokens = [(7 * i * i + 3 * i + 5) % 320 for i in range(40)]
    ref = _teacher_forced_logits(_runner(tiny_dir, torch.float32, "auto"), tokens, 8)
    got = _teacher_forced_logits(_runner(tiny_dir, torch.float32, kv), tokens, 8)
    err = ((got - ref).abs().max() / ref.abs().max()).item()
    agree = (got.argmax(-1) == ref.argmax(-1)).float().mean().item()
    print(f"{kv}: 32 decode steps, max |logit error| / max |logit| = {err:.4f}, argmax agreement {agree:.2f}")
    assert err < FP8_LOGIT_TOLERANCE[kv] and agree >= 0.7


def test_runner_rejects_unknown_kv_dtype(tiny_dir):
    model, config = load_model(tiny_dir)
    with pytest.raises(ValueError, match="unknown kv cache dtype"):
        ModelRunner(model, config, kv_cache_dtype="fp4")


def test_default_scale_is_one():
    assert kv_dtype.KV_SCALE == 1.0
    x = torch.randn(8)
    assert torch.equal(kv_dtype.dequantize(quantize(x, E4M3), torch.float32), x.to(E4M3).float())


def test_shard_config_reaches_the_pool(tiny_dir):
    """--kv-cache-dtype through ShardConfig (what `pagemill shard` builds) to the pool and Info."""
    from pagemill.config import ShardConfig

    def runner(kv):
        cfg = ShardConfig(model_dir=tiny_dir, uds_path="unused", dtype="bfloat16", block_size=TINY_BLOCK,
                          kv_cache_memory=1 << 20, kv_cache_dtype=kv)  # fmt: skip
        r = ModelRunner.from_shard_config(cfg)
        r.warmup(WARMUP)
        return r

    base, fp8 = runner("auto"), runner("fp8_e5m2")
    assert (base.pool.storage.dtype, fp8.pool.storage.dtype) == (torch.bfloat16, E5M2)
    assert fp8.pool.num_blocks == 2 * base.pool.num_blocks
    assert (base.info().kv_cache_dtype, fp8.info().kv_cache_dtype) == ("bfloat16", "fp8_e5m2")
