"""Weights and KV pool in huge pages (models/huge_pages.py): same numbers, ties kept, aligned."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from conftest import build_model_dir
from pagemill.models.huge_pages import HUGE_PAGE, huge_empty, huge_zeros, move_packed_to_huge_pages, move_to_huge_pages
from pagemill.models.loader import load_model
from pagemill.shard.kv_pool import KVPool
from test_model import PagedHarness, prompts

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _thp_mode() -> str | None:
    """'always', 'madvise' or 'never' (the bracketed one); None where the file is missing."""
    try:
        text = THP.read_text()
    except OSError:
        return None
    return text[text.index("[") + 1 : text.index("]")]


def test_huge_empty_is_aligned_and_advised_where_linux_allows():
    buf, advised = huge_empty(3 * HUGE_PAGE + 123)
    assert buf.dtype == torch.uint8 and buf.numel() == 3 * HUGE_PAGE + 123
    assert buf.data_ptr() % HUGE_PAGE == 0
    if sys.platform.startswith("linux") and _thp_mode() in ("always", "madvise"):
        assert advised
    buf.fill_(7)  # writable over its whole length
    assert int(buf[-1]) == 7


def test_huge_zeros_matches_torch_zeros():
    t = huge_zeros((3, 5, 7), torch.bfloat16)
    assert t.shape == (3, 5, 7) and t.dtype == torch.bfloat16 and t.is_contiguous()
    assert t.data_ptr() % HUGE_PAGE == 0 and torch.equal(t, torch.zeros(3, 5, 7, dtype=torch.bfloat16))


def test_kv_pool_in_huge_pages_is_zeroed_and_aligned(llama_dir):
    from pagemill.models.config import ModelConfig

    config = ModelConfig.from_model_dir(llama_dir)
    pool = KVPool.with_blocks(config, num_blocks=10, block_size=4, dtype=torch.float32, device="cpu", huge_pages=True)
    plain = KVPool.with_blocks(config, num_blocks=10, block_size=4, dtype=torch.float32, device="cpu")
    assert pool.storage.data_ptr() % HUGE_PAGE == 0
    assert pool.storage.shape == plain.storage.shape and torch.equal(pool.storage, plain.storage)
    k, v = pool.kv_caches[0]
    assert k.shape == plain.kv_caches[0][0].shape and v.shape == plain.kv_caches[0][1].shape


class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 8)
        self.head = nn.Linear(8, 50, bias=False)
        self.head.weight = self.embed.weight  # one Parameter, two modules
        self.norm = nn.Parameter(torch.randn(8))
        self.register_buffer("table", torch.arange(12, dtype=torch.int64))
        self.alias = nn.Parameter(torch.randn(6))
        self.register_buffer("alias_view", self.alias.data[:3])  # shares alias's storage


def test_move_keeps_values_ties_and_shared_storage():
    m = _Tied()
    before = {n: t.clone() for n, t in list(m.named_parameters()) + list(m.named_buffers())}
    alias_ptr = m.alias.data_ptr()
    moved = move_to_huge_pages(m)
    assert m.head.weight is m.embed.weight  # still tied
    assert m.alias.data_ptr() == alias_ptr and m.alias_view.data_ptr() == alias_ptr  # shared: left where it was
    for n, t in list(m.named_parameters()) + list(m.named_buffers()):
        assert torch.equal(t, before[n]), n
    # embed (50 x 8 float32), norm (8 float32), table (12 int64), each rounded up to 64 bytes
    assert moved == 1600 + 64 + 128
    # in module order (the root's own tensors, then its children's), back to back from a 2 MiB boundary
    start = m.norm.data_ptr()
    assert start % HUGE_PAGE == 0 and m.table.data_ptr() == start + 64 and m.embed.weight.data_ptr() == start + 192


def test_move_packed_copies_keeps_values_and_skips_the_rest():
    """Plain packed copies move, in module order; modules without one, or with a non-tensor, stay."""
    class Holder(nn.Module):
        def __init__(self, packed) -> None:
            super().__init__()
            self.packed = packed

    a, b = Holder(torch.arange(10, dtype=torch.bfloat16)), Holder(torch.arange(6.0).view(2, 3))
    root = nn.Sequential(a, Holder(None), b, Holder(torch.arange(8.0)[::2]))  # the last: not contiguous
    strided = root[3].packed
    assert move_packed_to_huge_pages(root) == 64 + 64
    assert a.packed.data_ptr() % HUGE_PAGE == 0 and b.packed.data_ptr() == a.packed.data_ptr() + 64
    assert torch.equal(a.packed, torch.arange(10, dtype=torch.bfloat16)) and torch.equal(b.packed, torch.arange(6.0).view(2, 3))
    assert root[3].packed is strided and root[1].packed is None
    assert move_packed_to_huge_pages(nn.Linear(2, 2)) == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_model_in_huge_pages_gives_bit_identical_logits(tmp_path, dtype):
    """The same arithmetic on the same values: only where the weights live differs. Tied
    embeddings (llama_mha_tied) stay one tensor."""
    model_dir = build_model_dir(str(tmp_path), "llama_mha_tied")
    ref, config = load_model(model_dir, dtype, "cpu")
    huge, _ = load_model(model_dir, dtype, "cpu", huge_pages=True)
    assert huge.lm_head.weight is huge.model.embed_tokens.weight
    assert huge.model.embed_tokens.weight.data_ptr() % HUGE_PAGE == 0
    if huge.lm_head.gemm is not None:  # bf16 with gemm_bf16 here: its packed copies have an arena of their own
        assert huge.model.layers[0].self_attn.qkv_proj.packed.data_ptr() % HUGE_PAGE == 0
    outs = []
    for model in (ref, huge):
        h = PagedHarness(model, config, dtype=dtype)
        seqs = dict(enumerate(prompts(config.vocab_size, [5, 9])))
        got = list(h.prefill(seqs).values())
        for _ in range(4):  # decode through the fused kernel (float32 and bf16 both take it)
            for sid, lg in h.decode(seqs).items():
                got.append(lg)
                seqs[sid] = seqs[sid] + [int(lg.argmax())]
        outs.append(got)
    for a, b in zip(*outs, strict=True):
        assert torch.equal(a, b)
