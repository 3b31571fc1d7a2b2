"""Sliding windows and logit soft-capping in the torch backend (and the CPU kernels
it calls) against a dense per-sequence reference written out in float64.

A mixed step covers every path of the backend: fresh prompts, a prompt chunk
over a cached prefix, and one-token rows that go through the batched decode
(the compiled paged kernel when `kernels`); a pure decode step covers the
decode path on its own, with contexts shorter and longer than the window.
"""

from __future__ import annotations

import pytest
import torch

from pagemill.attention.metadata import make_metadata
from pagemill.attention.torch_backend import TorchAttentionBackend
from pagemill.cpu_kernels.decode import decode_kernels

BLOCK, HEADS, KV_HEADS, DIM = 4, 4, 2, 16
SCALE = DIM**-0.5


def reference(q, keys, values, window, softcap):
    """q [n, H, D] at the last n of L positions; keys/values [L, kvh, D]. Key j is visible to the
    query at position p iff j <= p and j > p - window (transformers' sliding mask)."""
    n, total = q.shape[0], keys.shape[0]
    group = q.shape[1] // keys.shape[1]
    k = keys.double().repeat_interleave(group, dim=1).transpose(0, 1)  # [H, L, D]
    v = values.double().repeat_interleave(group, dim=1).transpose(0, 1)
    scores = q.double().transpose(0, 1) @ k.transpose(1, 2) * SCALE  # [H, n, L]
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    key = torch.arange(total)[None, :]
    query = torch.arange(total - n, total)[:, None]
    visible = (key <= query) & (key > query - (window or total + 1))
    scores = scores.masked_fill(~visible, float("-inf"))
    return (scores.softmax(-1) @ v).transpose(0, 1)


def run_step(backend, shape, window, softcap, is_prefill, dtype=torch.float32):
    """shape: (cached, new) per sequence. Returns (out, [(q rows, keys, values)] per sequence)."""
    torch.manual_seed(0)
    num_blocks = 64
    k_cache = torch.zeros(num_blocks, BLOCK, KV_HEADS, DIM, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    free = iter(torch.randperm(num_blocks - 1).add(1).tolist())  # shuffled, block 0 is scratch
    tables, slots, contexts = [], [], []
    for cached, new in shape:
        total = cached + new
        table = [next(free) for _ in range(-(-total // BLOCK))]
        ks, vs = torch.randn(total, KV_HEADS, DIM).to(dtype), torch.randn(total, KV_HEADS, DIM).to(dtype)
        for p in range(cached):  # the prefix already in the pool
            k_cache[table[p // BLOCK], p % BLOCK] = ks[p]
            v_cache[table[p // BLOCK], p % BLOCK] = vs[p]
        tables.append(table)
        slots += [table[p // BLOCK] * BLOCK + p % BLOCK for p in range(cached, total)]
        contexts.append((ks, vs))
    meta = make_metadata(is_prefill=is_prefill, query_lens=[n for _, n in shape], kv_lens=[c + n for c, n in shape],
                         block_tables=tables, slot_mapping=slots, device="cpu")  # fmt: skip
    q = torch.randn(sum(n for _, n in shape), HEADS, DIM).to(dtype)
    k = torch.cat([ks[c:] for (c, _), (ks, _) in zip(shape, contexts)])
    v = torch.cat([vs[c:] for (c, _), (_, vs) in zip(shape, contexts)])
    backend.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    if is_prefill:
        out = backend.prefill(q, k, v, k_cache, v_cache, meta, SCALE, window=window, softcap=softcap)
    else:
        out = backend.decode(q, k_cache, v_cache, meta, SCALE, window=window, softcap=softcap)
    return out, q, contexts


def check(out, q, shape, contexts, window, softcap, tol):
    start = 0
    for (cached, new), (ks, vs) in zip(shape, contexts):
        want = reference(q[start : start + new], ks, vs, window, softcap)
        torch.testing.assert_close(out[start : start + new].double(), want, atol=tol, rtol=tol)
        start += new


def backend_for(kernels: bool) -> TorchAttentionBackend:
    if kernels and decode_kernels() is None:
        pytest.skip("no C++ compiler for the CPU kernels")
    return TorchAttentionBackend(decode_kernels() if kernels else None)


# Decodes at contexts shorter than, equal to and longer than the windows below,
# a fresh prompt longer than them, a chunk over a cached prefix, a 1-token prompt.
MIXED = [(9, 1), (0, 11), (3, 1), (5, 6), (14, 1), (0, 1), (2, 1)]
WINDOWS = [None, 3, 5, 64]


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("softcap", [None, 2.0])
@pytest.mark.parametrize("kernels", [False, True], ids=["torch", "kernels"])
def test_mixed_step(window, softcap, kernels):
    backend = backend_for(kernels)
    out, q, contexts = run_step(backend, MIXED, window, softcap, is_prefill=True)
    check(out, q, MIXED, contexts, window, softcap, 1e-5)


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("softcap", [None, 2.0])
@pytest.mark.parametrize("kernels", [False, True], ids=["torch", "kernels"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_decode(window, softcap, kernels, dtype):
    backend = backend_for(kernels)
    shape = [(c, 1) for c in (0, 2, 4, 7, 12, 30)]
    out, q, contexts = run_step(backend, shape, window, softcap, is_prefill=False, dtype=dtype)
    check(out, q, shape, contexts, window, softcap, 1e-5 if dtype == torch.float32 else 3e-2)


def test_window_changes_the_result():
    """The window is really applied: a 5-key window differs from global attention past 5 keys."""
    backend = TorchAttentionBackend()
    shape = [(0, 11), (14, 1), (5, 6)]
    glob, *_ = run_step(backend, shape, None, None, is_prefill=True)
    windowed, *_ = run_step(backend, shape, 5, None, is_prefill=True)
    assert torch.equal(glob[:5], windowed[:5])  # the first 5 queries see no more than 5 keys either way
    assert not torch.allclose(glob[5:11], windowed[5:11])
