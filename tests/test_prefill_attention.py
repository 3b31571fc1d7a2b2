"""The query-tiled prefill attention kernel (cpu_kernels/csrc/attention/prefill_attention.h) against
dense float64 attention over the same keys, for float32 and bfloat16 pools, in the
native build and the builds with the AMX / AVX512-BF16 / AVX-512 paths compiled out (on an
AMX-BF16 CPU the native build's bf16 tiles of head size 64, 128 and 256 multiply on AMX tiles,
prefill_attention_amx.h).

Tolerances: float32 2e-5 absolute + 1e-4 relative (float32 arithmetic against float64);
bfloat16 2^-7 relative + 4e-3 absolute per element, and a mean absolute error under 1e-3
(the output is rounded to bf16, 2^-8; with AVX512-BF16 the probabilities meet the values
as bf16, as in torch's bf16 attention; measured: max and mean errors no larger than
the torch bf16 path's against the same float64 reference, ~8e-3 and ~3-7e-4)."""

from __future__ import annotations

import random

import pytest
import torch

from pagemill.attention.metadata import make_metadata
from pagemill.attention.torch_backend import TorchAttentionBackend
from pagemill.cpu_kernels.build import build_library
from pagemill.cpu_kernels.decode import DecodeKernels, decode_kernels

kernels = decode_kernels()
pytestmark = pytest.mark.skipif(kernels is None, reason="no C++ compiler / not x86-64 Linux")

BLOCK, NUM_BLOCKS, KV_HEADS = 16, 160, 2
# (cached prefix, new tokens): fresh prompts, block-aligned and unaligned prefixes,
# one-token chunks (a decode row in a mixed step), chunks of 1..300 tokens.
SHAPES = [(0, 1), (0, 300), (16, 33), (37, 5), (5, 1), (48, 64), (0, 17), (130, 170), (7, 2)]
TOL = {torch.float32: dict(atol=2e-5, rtol=1e-4), torch.bfloat16: dict(atol=4e-3, rtol=2**-7)}
MEAN_TOL = {torch.float32: 1e-6, torch.bfloat16: 1e-3}


NO_AMX = ("-mno-amx-tile", "-mno-amx-bf16", "-mno-amx-int8")


@pytest.fixture(scope="module", params=[(), NO_AMX, ("-mno-avx512bf16",), ("-mno-avx512f",)],
                ids=["native", "no-amx", "no-avx512bf16", "no-avx512f"])  # fmt: skip
def library(request) -> DecodeKernels:
    if not request.param:
        return kernels
    if request.param == NO_AMX and not kernels.prefill_on_amx(64):
        pytest.skip("the native build has no AMX path here: it is the no-amx build")
    lib = build_library(request.param)
    assert lib is not None, f"kernel build with {request.param} failed"
    return DecodeKernels(lib)


def dense(q, k, v, cached: int, scale: float, window: int | None) -> torch.Tensor:
    """q [n, H, D] at positions cached..cached+n-1 against k/v [cached+n, kvh, D], in float64."""
    n, heads, _ = q.shape
    group = heads // k.shape[1]
    key_pos, query_pos = torch.arange(k.shape[0]), torch.arange(cached, cached + n)
    mask = key_pos[None, :] <= query_pos[:, None]
    if window is not None:
        mask &= key_pos[None, :] > query_pos[:, None] - window
    out = torch.empty(q.shape, dtype=torch.float64)
    for h in range(heads):
        scores = q[:, h].double() @ k[:, h // group].double().T * scale
        out[:, h] = scores.masked_fill(~mask, float("-inf")).softmax(-1) @ v[:, h // group].double()
    return out


class Step:
    """A step of prompt chunks over sequences stored under scattered block tables."""

    def __init__(self, shapes, group: int, head_dim: int, dtype, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        heads = KV_HEADS * group
        free = list(range(1, NUM_BLOCKS))
        random.Random(seed).shuffle(free)
        shape = (NUM_BLOCKS, BLOCK, KV_HEADS, head_dim)
        self.k_cache, self.v_cache = torch.randn(shape, generator=g).to(dtype), torch.randn(shape, generator=g).to(dtype)
        self.shapes, tables, slots, self.seqs = shapes, [], [], []
        for cached, n in shapes:
            table = [free.pop() for _ in range(-(-(cached + n) // BLOCK))]
            tables.append(table)
            slots += [table[p // BLOCK] * BLOCK + p % BLOCK for p in range(cached, cached + n)]
            rows = torch.tensor([table[p // BLOCK] * BLOCK + p % BLOCK for p in range(cached + n)])
            self.seqs.append((rows, torch.randn(n, heads, head_dim, generator=g).to(dtype)))
        self.meta = make_metadata(is_prefill=True, query_lens=[n for _, n in shapes],
                                  kv_lens=[c + n for c, n in shapes], block_tables=tables, slot_mapping=slots,
                                  device="cpu")  # fmt: skip
        self.q = torch.cat([q for _, q in self.seqs])

    def keys(self, i: int):
        rows = self.seqs[i][0]
        return (self.k_cache.flatten(0, 1).index_select(0, rows), self.v_cache.flatten(0, 1).index_select(0, rows))

    def expected(self, scale: float, window: int | None) -> torch.Tensor:
        return torch.cat([dense(q, *self.keys(i), c, scale, window) for i, ((c, _), (_, q)) in
                          enumerate(zip(self.shapes, self.seqs))])  # fmt: skip


@pytest.mark.parametrize("window", [None, 7, 40])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_dense_attention(library, dtype, group, head_dim, window):
    step = Step(SHAPES, group, head_dim, dtype, seed=group * 7 + head_dim)
    scale = head_dim**-0.5
    m = step.meta
    out = library.prefill_attention(step.q, step.k_cache, step.v_cache, m.block_tables, m.cu_seqlens_q,
                                    m.context_lens, scale, window)  # fmt: skip
    assert out.dtype == dtype
    expected = step.expected(scale, window)
    torch.testing.assert_close(out.double(), expected, **TOL[dtype])
    assert (out.double() - expected).abs().mean() < MEAN_TOL[dtype]


@pytest.mark.parametrize("head_dim", [48, 80, 256])
def test_other_head_sizes(library, head_dim):
    step = Step([(0, 40), (21, 19), (3, 1)], 3, head_dim, torch.bfloat16, seed=head_dim)
    m = step.meta
    out = library.prefill_attention(step.q, step.k_cache, step.v_cache, m.block_tables, m.cu_seqlens_q,
                                    m.context_lens, 0.1, None)  # fmt: skip
    torch.testing.assert_close(out.double(), step.expected(0.1, None), **TOL[torch.bfloat16])


def test_amx_path_is_the_one_built_here():
    """Where the CPU has AMX-BF16 (and Linux grants the tiles) bf16 prompt chunks of the common
    head sizes take them; other head sizes keep the vdpbf16ps tile."""
    from pagemill.models.auto_dtype import cpu_flags

    flags = cpu_flags()
    amx = {"amx_tile", "amx_bf16", "avx512_bf16"} <= flags
    assert [kernels.prefill_on_amx(d) for d in (64, 128, 256)] == [amx] * 3
    assert not any(kernels.prefill_on_amx(d) for d in (48, 80, 96, 160))


def test_strided_queries():
    """q as a view of a packed qkv projection (tokens further apart than heads x head_dim)."""
    step = Step([(10, 30), (0, 9)], 3, 64, torch.float32, seed=5)
    packed = torch.cat([step.q.flatten(1), torch.randn(step.q.shape[0], 5 * 64)], dim=1)
    q = packed[:, : step.q.shape[1] * 64].view_as(step.q)
    m = step.meta
    out = kernels.prefill_attention(q, step.k_cache, step.v_cache, m.block_tables, m.cu_seqlens_q, m.context_lens,
                                    0.125, None)  # fmt: skip
    torch.testing.assert_close(out.double(), step.expected(0.125, None), **TOL[torch.float32])


def test_rejects_bad_shapes():
    step = Step([(0, 4)], 1, 64, torch.float32)
    m = step.meta
    three_heads = torch.randn(4, 3, 64)  # against 2 kv heads
    with pytest.raises(ValueError, match="multiple"):
        kernels.prefill_attention(three_heads, step.k_cache, step.v_cache, m.block_tables, m.cu_seqlens_q,
                                  m.context_lens, 0.1)  # fmt: skip
    with pytest.raises(ValueError, match="fewer keys"):
        kernels.prefill_attention(step.q, step.k_cache, step.v_cache, m.block_tables, m.cu_seqlens_q,
                                  m.context_lens - 1, 0.1)  # fmt: skip


@pytest.mark.parametrize("window", [None, 24])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_backend_prefill_uses_it(dtype, window, monkeypatch):
    """TorchAttentionBackend.prefill with the kernels: chunks of any length, mixed steps."""
    step = Step([(0, 70), (9, 1), (32, 1), (0, 1100), (17, 40)], 3, 64, dtype, seed=11)
    backend = TorchAttentionBackend(kernels)
    calls = []
    monkeypatch.setattr(type(kernels), "paged_attention", lambda *a, **k: calls.append(a))
    out = backend.prefill(step.q, None, None, step.k_cache, step.v_cache, step.meta, 0.125, window)
    assert not calls  # not the per-token path
    torch.testing.assert_close(out.double(), step.expected(0.125, window), **TOL[dtype])
