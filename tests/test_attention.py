"""Torch paged-attention backend against naive dense attention on random data."""

from __future__ import annotations

import random

import pytest
import torch

from pagemill.attention.backend import select_backend
from pagemill.attention.metadata import make_metadata
from pagemill.attention.torch_backend import TorchAttentionBackend
from pagemill.cpu_kernels.decode import decode_kernels

BLOCK_SIZE = 8
NUM_BLOCKS = 64
KV_HEADS = 2


def naive_attention(q, k, v, cached: int, scale: float) -> torch.Tensor:
    """q [n, H, D] at positions cached..cached+n-1; k/v [cached+n, kvh, D] dense. Loops, no tricks."""
    n, heads, _ = q.shape
    ratio = heads // k.shape[1]
    out = torch.empty_like(q)
    for h in range(heads):
        kh, vh = k[:, h // ratio].double(), v[:, h // ratio].double()
        scores = q[:, h].double() @ kh.T * scale  # [n, L]
        for j in range(n):
            scores[j, cached + j + 1 :] = float("-inf")
        out[:, h] = (scores.softmax(-1) @ vh).to(q.dtype)
    return out


class Setup:
    """Random sequences stored in a cache under shuffled block tables."""

    def __init__(self, head_dim: int, ratio: int, dtype=torch.float32, seed: int = 0, kernels: bool = False) -> None:
        self.g = torch.Generator().manual_seed(seed)
        self.heads, self.head_dim, self.dtype = KV_HEADS * ratio, head_dim, dtype
        shape = (NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, head_dim)
        self.k_cache, self.v_cache = torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)
        self.free = list(range(1, NUM_BLOCKS))
        random.Random(seed).shuffle(self.free)
        self.backend = TorchAttentionBackend(decode_kernels() if kernels else None)

    def rand(self, *shape):
        return torch.randn(*shape, generator=self.g).to(self.dtype)

    def sequence(self, length: int):
        table = [self.free.pop() for _ in range(-(-length // BLOCK_SIZE))]
        slots = [table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(length)]
        return table, slots, self.rand(length, KV_HEADS, self.head_dim), self.rand(length, KV_HEADS, self.head_dim)

    def write(self, k, v, slots):
        self.backend.write_kv(k, v, self.k_cache, self.v_cache, torch.tensor(slots, dtype=torch.int64))


@pytest.mark.parametrize("kernels", [False, True], ids=["torch", "compiled"])
@pytest.mark.parametrize("ratio", [1, 3, 8])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_prefill_matches_naive(ratio, head_dim, kernels):
    if kernels and decode_kernels() is None:
        pytest.skip("no compiled CPU kernels here")
    s = Setup(head_dim, ratio, kernels=kernels)
    scale = head_dim**-0.5
    # (cached prefix, new tokens): fresh prompts, cached prefixes aligned and not, a 1-token suffix
    shapes = [(0, 17), (9, 5), (16, 1), (3, 30), (0, 1)]
    q_all, k_new, v_new, new_slots, tables, expected = [], [], [], [], [], []
    for cached, n in shapes:
        table, slots, k, v = s.sequence(cached + n)
        s.write(k[:cached], v[:cached], slots[:cached])  # the prefix computed in an earlier step
        q = s.rand(n, s.heads, head_dim)
        q_all.append(q), k_new.append(k[cached:]), v_new.append(v[cached:])
        new_slots += slots[cached:]
        tables.append(table)
        expected.append(naive_attention(q, k, v, cached, scale))
    meta = make_metadata(
        is_prefill=True,
        query_lens=[n for _, n in shapes],
        kv_lens=[c + n for c, n in shapes],
        block_tables=tables,
        slot_mapping=new_slots,
        device="cpu",
    )
    q, k, v = torch.cat(q_all), torch.cat(k_new), torch.cat(v_new)
    s.backend.write_kv(k, v, s.k_cache, s.v_cache, meta.slot_mapping)  # as the model does
    out = s.backend.prefill(q, k, v, s.k_cache, s.v_cache, meta, scale)
    torch.testing.assert_close(out, torch.cat(expected), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("ratio", [1, 3, 8])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_decode_matches_naive(ratio, head_dim):
    s = Setup(head_dim, ratio, seed=1)
    scale = head_dim**-0.5
    lengths = [1, 8, 33, 70, 9]  # block-aligned and not; very different widths -> padded tables
    qs, tables, slots_now, expected = [], [], [], []
    for length in lengths:
        table, slots, k, v = s.sequence(length)
        s.write(k[:-1], v[:-1], slots[:-1])
        q = s.rand(1, s.heads, head_dim)
        qs.append(q), tables.append(table)
        slots_now.append(slots[-1])
        s.write(k[-1:], v[-1:], slots[-1:])  # the step's own token, written before attention
        expected.append(naive_attention(q, k, v, length - 1, scale))
    meta = make_metadata(
        is_prefill=False,
        query_lens=[1] * len(lengths),
        kv_lens=lengths,
        block_tables=tables,
        slot_mapping=slots_now,
        device="cpu",
    )
    assert meta.block_tables.shape == (len(lengths), -(-max(lengths) // BLOCK_SIZE))
    out = s.backend.decode(torch.cat(qs), s.k_cache, s.v_cache, meta, scale)
    torch.testing.assert_close(out, torch.cat(expected), atol=2e-5, rtol=1e-4)


def test_bfloat16_cache():
    s = Setup(64, 3, dtype=torch.bfloat16, seed=2)
    table, slots, k, v = s.sequence(21)
    s.write(k, v, slots)
    q = s.rand(1, s.heads, 64)
    meta = make_metadata(
        is_prefill=False, query_lens=[1], kv_lens=[21], block_tables=[table], slot_mapping=[slots[-1]], device="cpu"
    )
    out = s.backend.decode(q, s.k_cache, s.v_cache, meta, 64**-0.5)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), naive_attention(q.float(), k.float(), v.float(), 20, 64**-0.5),
                               atol=2e-2, rtol=2e-2)  # fmt: skip


def test_write_kv_places_tokens_at_their_slots():
    s = Setup(64, 1)
    table, slots, k, v = s.sequence(11)
    s.write(k, v, slots)
    for p, slot in enumerate(slots):
        block, offset = divmod(slot, BLOCK_SIZE)
        assert torch.equal(s.k_cache[block, offset], k[p]) and torch.equal(s.v_cache[block, offset], v[p])
    assert not s.k_cache[0].any()  # nothing landed in the scratch block


def test_select_backend():
    assert select_backend("auto", "cpu").name == "torch"
    assert select_backend("torch", "cpu").name == "torch"
    with pytest.raises(RuntimeError, match="needs a CUDA device"):
        select_backend("flash", "cpu")
    with pytest.raises(RuntimeError, match="needs a CUDA device"):
        select_backend("triton", "cpu")
    with pytest.raises(ValueError, match="unknown attention backend"):
        select_backend("xformers", "cpu")
