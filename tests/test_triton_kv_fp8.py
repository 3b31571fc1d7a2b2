"""Triton kernels over an fp8 KV pool, against the torch backend on the same fp8 pool.

Both read the same fp8 bytes and widen them to the compute dtype, so they
must agree to float32 accuracy (the fp8 rounding itself is measured in
test_kv_fp8.py). On CPU the kernels run in Triton's interpreter, which loads
and stores float8e4nv / float8e5 (checked with triton 3.9); as in
test_triton_attention.py a child pytest with TRITON_INTERPRET=1 runs them.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys

import pytest
import torch

from pagemill.attention.kv_dtype import quantize
from pagemill.attention.metadata import make_metadata
from pagemill.attention.torch_backend import TorchAttentionBackend

ON_CUDA = torch.cuda.is_available()
IN_INTERPRETER = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cuda" if ON_CUDA else "cpu"
kernel_test = pytest.mark.skipif(
    not (ON_CUDA or IN_INTERPRETER),
    reason="no CUDA: runs in test_fp8_kernels_in_interpreter's TRITON_INTERPRET=1 child",
)
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FP8 = [pytest.param(E4M3, id="e4m3"), pytest.param(E5M2, id="e5m2")]
BLOCK_SIZE, KV_HEADS, HEAD_DIM, GROUP = 16, 2, 64, 3


def _needs_e4m3(dtype):
    if ON_CUDA and dtype == E4M3 and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("Triton's float8e4nv needs compute capability >= 8.9")


@pytest.mark.skipif(ON_CUDA or IN_INTERPRETER, reason="the kernel tests run in this process")
def test_fp8_kernels_in_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    child = subprocess.run([sys.executable, "-m", "pytest", __file__, "-q", "-p", "no:cacheprovider"],
                           env=env, capture_output=True, text=True, timeout=600)  # fmt: skip
    assert child.returncode == 0, child.stdout[-6000:] + child.stderr[-2000:]
    print(child.stdout.strip().splitlines()[-1])


def _case(dtype, shapes, seed=0):
    """fp8 pool with (cached, new) tokens per sequence written by the torch backend; q of the new tokens."""
    g = torch.Generator().manual_seed(seed)
    free = list(range(1, 48))
    random.Random(seed).shuffle(free)
    k_cache = torch.zeros(48, BLOCK_SIZE, KV_HEADS, HEAD_DIM, dtype=dtype, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    tables, slots, qs = [], [], []
    for cached, n in shapes:
        total = cached + n
        table = [free.pop() for _ in range(-(-total // BLOCK_SIZE))]
        seq = [table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(total)]
        k = torch.randn(total, KV_HEADS, HEAD_DIM, generator=g).to(DEVICE)
        v = torch.randn(total, KV_HEADS, HEAD_DIM, generator=g).to(DEVICE)
        TorchAttentionBackend().write_kv(k, v, k_cache, v_cache, torch.tensor(seq, device=DEVICE))
        tables.append(table), slots.extend(seq[cached:])
        qs.append(torch.randn(n, KV_HEADS * GROUP, HEAD_DIM, generator=g).to(DEVICE))
    meta = make_metadata(is_prefill=any(n > 1 for _, n in shapes), query_lens=[n for _, n in shapes],
                         kv_lens=[c + n for c, n in shapes], block_tables=tables, slot_mapping=slots,
                         device=DEVICE)  # fmt: skip
    return torch.cat(qs), k_cache, v_cache, meta


def _rel(out, ref):
    return ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


@kernel_test
@pytest.mark.parametrize("dtype", FP8)
def test_write_kv_fp8_saturates_and_rounds(dtype):
    from pagemill.attention.kernels import write_kv

    _needs_e4m3(dtype)
    g = torch.Generator().manual_seed(0)
    k = (torch.randn(5, KV_HEADS, HEAD_DIM, generator=g) * 3).to(DEVICE)
    k[0, 0, :4] = torch.tensor([1e6, -1e6, 500.0, -500.0])
    v = torch.randn(5, KV_HEADS, HEAD_DIM, generator=g).to(DEVICE)
    k_cache = torch.zeros(4, BLOCK_SIZE, KV_HEADS, HEAD_DIM, dtype=dtype, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.tensor([17, 3, 40, 63, 18], device=DEVICE)
    write_kv(k, v, k_cache, v_cache, slots)
    got_k = k_cache.view(-1, KV_HEADS, HEAD_DIM)[slots].float()
    want_k = quantize(k, dtype).float()
    assert torch.isfinite(got_k).all()
    limit = torch.finfo(dtype).max
    assert got_k[0, 0, :2].tolist() == [limit, -limit]
    got_v = v_cache.view(-1, KV_HEADS, HEAD_DIM)[slots].float()
    for got, want in ((got_k, want_k), (got_v, quantize(v, dtype).float())):
        if ON_CUDA:  # cvt.rn.satfinite: round to nearest even, as torch's cast of the clamped value
            assert torch.equal(got, want)
        else:
            # Triton 3.9's interpreter rounds fp32 -> fp8 to nearest but drops the carry when the
            # mantissa rounds up into the next power of two (7.83 -> 4.0 instead of 8.0) and gets
            # subnormals wrong; only such entries may differ. Compiled kernels use the GPU's cvt.
            bad = got != want
            carry = got[bad] == want[bad] / 2
            subnormal = want[bad].abs() < torch.finfo(dtype).smallest_normal * 2
            assert (carry | subnormal).all(), (got[bad][~(carry | subnormal)], want[bad][~(carry | subnormal)])
            assert bad.float().mean() < 0.1
    untouched = torch.ones(4 * BLOCK_SIZE, dtype=torch.bool)
    untouched[slots.cpu()] = False
    assert k_cache.view(-1, KV_HEADS, HEAD_DIM)[untouched.to(DEVICE)].float().abs().sum() == 0


@kernel_test
@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("partition", [None, 64], ids=["unsplit", "split"])
def test_decode_fp8_matches_torch(dtype, partition):
    from pagemill.attention.kernels import paged_decode

    _needs_e4m3(dtype)
    q, k_cache, v_cache, meta = _case(dtype, [(c, 1) for c in (0, 6, 31, 80, 130)])
    scale = HEAD_DIM**-0.5
    ref = TorchAttentionBackend().decode(q, k_cache, v_cache, meta, scale)
    part = partition or meta.max_seqlen_k
    out = paged_decode(q, k_cache, v_cache, meta.block_tables, meta.context_lens, meta.max_seqlen_k, scale, part)
    assert _rel(out, ref) < 1e-3


@kernel_test
@pytest.mark.parametrize("dtype", FP8)
def test_prefill_fp8_matches_torch(dtype):
    """Cached prefixes, so the torch reference reads every key from the fp8 pool as the kernel does."""
    from pagemill.attention.kernels import paged_prefill

    _needs_e4m3(dtype)
    q, k_cache, v_cache, meta = _case(dtype, [(20, 5), (33, 12), (1, 17)], seed=1)
    scale = HEAD_DIM**-0.5
    ref = TorchAttentionBackend().prefill(q, None, None, k_cache, v_cache, meta, scale)
    out = paged_prefill(q, k_cache, v_cache, meta.block_tables, meta.cu_seqlens_q, meta.context_lens,
                        meta.max_seqlen_q, scale)  # fmt: skip
    assert _rel(out, ref) < 1e-3


@kernel_test
@pytest.mark.parametrize("kv", [pytest.param(torch.float32, id="fp32"), *FP8])
def test_static_decode_inputs_on_triton(tmp_path, kv):
    """The CUDA-graph path's static metadata on the triton backend (eagerly here): a grid sized for
    the full table width, split-K forced (as on a 132-SM GPU), early exit at context_lens; logits
    equal the normal triton decode's over the same pool."""
    from conftest import build_model_dir
    from test_cuda_graphs import Setup

    _needs_e4m3(kv)
    s = Setup(build_model_dir(str(tmp_path / "m"), "llama_gqa"), device=DEVICE, backend="triton", kv_dtype=kv)
    s.model.backend.num_sms = 132
    for length in (3, 17, 30, 9, 1):
        s.add(length)
    graphs = s.graphs(max_total_tokens=1024)  # static width 1024 tokens: 4 partitions of 256
    inputs = s.decode_inputs(s.seqs)
    before = s.pool.storage.clone()
    ref = s.eager_logits(inputs)
    s.pool.storage.copy_(before)
    with torch.inference_mode():
        got = graphs.logits_for(inputs)
    assert _rel(got, ref) < 1e-5
