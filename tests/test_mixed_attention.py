"""Attention over a mixed step (decode tokens next to prompt chunks): in torch the
one-token rows go through the batched decode path, the rest through varlen
prefill; with the compiled kernels the leading one-token rows (the router plans
decode rows first) take the decode kernel and the rest one prefill_attention call.
Every row must equal attending to its own context alone."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagemill.attention.metadata import make_metadata
from pagemill.attention.torch_backend import TorchAttentionBackend
from pagemill.cpu_kernels.decode import decode_kernels

BLOCK, HEADS, KV_HEADS, DIM = 4, 4, 2, 16


def reference(q, keys, values, scale):
    """q [n, H, D] at the last n of L positions; keys/values [L, kvh, D]."""
    n, total = q.shape[0], keys.shape[0]
    mask = torch.arange(total)[None, :] <= torch.arange(total - n, total)[:, None]
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], keys.transpose(0, 1)[None], values.transpose(0, 1)[None],
        attn_mask=mask, scale=scale, enable_gqa=True,
    )
    return out[0].transpose(0, 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kernels", [False, True])
@pytest.mark.parametrize(
    "shape",
    [
        # (cached, new): decodes, a fresh prompt, a chunk over a cached prefix, more decodes.
        [(9, 1), (0, 7), (3, 1), (5, 6), (14, 1), (1, 1)],
        # The router's order: every decode row first, then the chunks.
        [(9, 1), (3, 1), (14, 1), (1, 1), (0, 7), (5, 6)],
        # Decode rows only, in a step planned as a prefill.
        [(9, 1), (3, 1), (14, 1)],
    ],
    ids=["interleaved", "decode-first", "decode-only"],
)
def test_mixed_step_rows_match_their_own_context(dtype, kernels, shape, monkeypatch):
    if kernels and decode_kernels() is None:
        pytest.skip("no C++ compiler for the CPU kernels")
    torch.manual_seed(0)
    backend = TorchAttentionBackend(decode_kernels() if kernels else None)
    decoded = []
    if kernels:  # which rows the decode kernel attends
        plain = backend.kernels.paged_attention

        def spy(q, *args):
            decoded.append(q.shape[0])
            return plain(q, *args)

        monkeypatch.setattr(backend.kernels, "paged_attention", spy)
    num_blocks = 64
    k_cache = torch.zeros(num_blocks, BLOCK, KV_HEADS, DIM, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    free = iter(range(1, num_blocks))
    tables, slots, contexts = [], [], []
    for cached, new in shape:
        total = cached + new
        table = [next(free) for _ in range(-(-total // BLOCK))]
        ks = torch.randn(total, KV_HEADS, DIM).to(dtype)
        vs = torch.randn(total, KV_HEADS, DIM).to(dtype)
        for p in range(cached):  # the prefix already in the pool
            k_cache[table[p // BLOCK], p % BLOCK] = ks[p]
            v_cache[table[p // BLOCK], p % BLOCK] = vs[p]
        tables.append(table)
        slots += [table[p // BLOCK] * BLOCK + p % BLOCK for p in range(cached, total)]
        contexts.append((ks, vs))
    meta = make_metadata(is_prefill=True, query_lens=[n for _, n in shape], kv_lens=[c + n for c, n in shape],
                         block_tables=tables, slot_mapping=slots, device="cpu")
    q = torch.randn(sum(n for _, n in shape), HEADS, DIM).to(dtype)
    k = torch.cat([ks[c:] for (c, _), (ks, _) in zip(shape, contexts)])
    v = torch.cat([vs[c:] for (c, _), (_, vs) in zip(shape, contexts)])
    backend.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    out = backend.prefill(q, k, v, k_cache, v_cache, meta, scale=DIM**-0.5)
    if kernels:  # compiled calls only (paged_attention.h, prefill_attention.h)
        assert "singles" not in meta.derived, "the step did not take the compiled path"
        leading = next((i for i, (_, n) in enumerate(shape) if n != 1), len(shape))
        assert decoded == ([leading] if leading else []), "the leading one-token rows attend as a decode step"
    else:
        assert meta.derived["singles"] is not None, "the one-token rows did not take the batched path"
    start = 0
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for (cached, new), (ks, vs) in zip(shape, contexts):
        want = reference(q[start : start + new].float(), ks.float(), vs.float(), DIM**-0.5)
        torch.testing.assert_close(out[start : start + new].float(), want, atol=tol, rtol=tol)
        start += new
