"""The compiled decode kernels (cpu_kernels/csrc/decode/decode.cpp) against the torch path and transformers.

- whole-layer small-batch decode (models/fused_decode.py): every tiny
  variant, batches of 1..FUSED_MAX_BATCH, greedy steps across block
  boundaries, logits against HF;
- paged attention for a batch of single-token queries: against the pure
  torch reference decode on shuffled block tables, and in a served batch.
Skipped where the kernels cannot be built (no compiler, not x86-64 Linux).
"""

from __future__ import annotations

import pytest
import torch
from test_model import PagedHarness, assert_close, hf_logits, prompts

from pagemill.attention.metadata import make_metadata
from pagemill.attention.kv_dtype import quantize_int8, widen
from pagemill.attention.torch_backend import TorchAttentionBackend
from pagemill.cpu_kernels.decode import decode_kernels
from pagemill.models.fused_decode import FUSED_MAX_BATCH
from pagemill.models.loader import load_model

kernels = decode_kernels()
pytestmark = pytest.mark.skipif(kernels is None, reason="no C++ compiler / not x86-64 Linux")


class Spy:
    """Counts the forwards that took the fused path."""

    def __init__(self, inner) -> None:
        self.inner, self.calls = inner, 0

    def applies(self, *args) -> bool:
        return self.inner.applies(*args)

    def __call__(self, *args):
        self.calls += 1
        return self.inner(*args)


def greedy(h: PagedHarness, seqs: dict[int, list[int]], steps: int) -> list[tuple[int, int, torch.Tensor]]:
    """Prefill, then `steps` decode steps; (seq, position of the logits row, logits) of every decode."""
    for sid, lg in h.prefill(seqs).items():
        seqs[sid] = seqs[sid] + [int(lg[-1].argmax())]
    seen = []
    for _ in range(steps):
        for sid, lg in h.decode(seqs).items():
            seen.append((sid, len(seqs[sid]) - 1, lg))
            seqs[sid] = seqs[sid] + [int(lg.argmax())]
    return seen


@pytest.mark.parametrize("batch", [1, 3, FUSED_MAX_BATCH])
def test_fused_decode_matches_transformers(tiny_model, batch):
    name, model_dir, hf = tiny_model
    model, config = load_model(model_dir, "float32", "cpu")
    assert model.model.fused is not None, "float32 CPU model without tensor parallelism takes the fused path"
    spy = model.model.fused = Spy(model.model.fused)
    seqs = dict(enumerate(prompts(config.vocab_size, [6, 1, 9, 4, 13][:batch])))
    seen = greedy(PagedHarness(model, config), seqs, steps=14)  # 6 + 14 tokens: 5 blocks of 4
    assert spy.calls == 14
    ref = {sid: hf_logits(hf, tokens) for sid, tokens in seqs.items()}
    for sid, pos, lg in seen:
        assert_close(lg, ref[sid][pos], f"{name} fused decode batch {batch} seq {sid} position {pos}")


def test_fused_matches_module_path_on_default_model(default_model_dir):
    """SmolLM2 (GQA 9/3, 30 layers): fused and module path on the same cache, step by step."""
    model, config = load_model(str(default_model_dir), "float32", "cpu")
    fused = model.model.fused
    assert fused is not None
    h = PagedHarness(model, config, num_blocks=64)
    seqs = dict(enumerate(prompts(config.vocab_size, [21, 5])))
    for sid, lg in h.prefill(seqs).items():
        seqs[sid] = seqs[sid] + [int(lg[-1].argmax())]
    for _ in range(4):
        model.model.fused = None
        ref = h.decode(seqs)  # writes this step's k/v; the fused step rewrites the same values
        model.model.fused = fused
        out = h.decode(seqs)
        for sid in seqs:
            assert_close(out[sid], ref[sid], f"fused vs module path seq {sid}")
            seqs[sid] = seqs[sid] + [int(out[sid].argmax())]


def test_fused_path_is_skipped_where_it_does_not_apply(llama_dir):
    model, config = load_model(llama_dir, "float32", "cpu")
    fused = model.model.fused
    x = torch.zeros(1, config.hidden_size)

    def meta(is_prefill=False, n=1):
        return make_metadata(is_prefill=is_prefill, query_lens=[1] * n, kv_lens=[3] * n, block_tables=[[1]] * n,
                             slot_mapping=list(range(n)), device="cpu")  # fmt: skip

    caches = [(torch.zeros(4, 4, 2, 16), torch.zeros(4, 4, 2, 16))]
    assert fused.applies(x, meta(), caches)
    assert not fused.applies(x, meta(is_prefill=True), caches)
    assert fused.applies(torch.zeros(2, config.hidden_size), meta(n=2), caches)
    n = FUSED_MAX_BATCH + 1
    assert not fused.applies(torch.zeros(n, config.hidden_size), meta(n=n), caches)
    fp8 = [tuple(c.to(torch.float8_e4m3fn) for c in caches[0])]
    assert not fused.applies(x, meta(), fp8)
    # --no-cpu-kernels and float16 models never build it; a bf16 one takes only a bf16 pool.
    assert load_model(llama_dir, "float32", "cpu", cpu_kernels=False)[0].model.fused is None
    assert load_model(llama_dir, "float16", "cpu")[0].model.fused is None
    bf16 = load_model(llama_dir, "bfloat16", "cpu")[0].model.fused
    assert bf16.applies(x.bfloat16(), meta(), [tuple(c.bfloat16() for c in caches[0])])
    assert not bf16.applies(x.bfloat16(), meta(), caches)

    # One call runs every layer: a KV cache per layer, or it is refused before anything runs.
    h = PagedHarness(model, config, num_blocks=4)
    cos_sin = (torch.ones(1, config.head_dim),) * 2
    with pytest.raises(ValueError, match="KV caches for"):
        fused(x, *cos_sin, meta(), h.pool.kv_caches[:-1])
    short = make_metadata(is_prefill=False, query_lens=[1], kv_lens=[0], block_tables=[[1]], slot_mapping=[0],
                          device="cpu")  # fmt: skip
    with pytest.raises(ValueError, match="fused decode layer 0 rejected its shapes"):
        fused(x, *cos_sin, short, h.pool.kv_caches)


@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size", [(4, 2, 16, 4), (9, 3, 64, 16), (4, 4, 32, 8),
                                                                (6, 1, 8, 5), (7, 1, 64, 16), (8, 1, 64, 16),
                                                                (6, 1, 128, 16)])  # fmt: skip
def test_paged_attention_matches_torch_reference(heads, kv_heads, head_dim, block_size):
    g = torch.Generator().manual_seed(heads * 100 + head_dim + block_size)
    num_blocks, lens = 64, [1, block_size, block_size + 1, 37, 2 * block_size - 1, 50]
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g)
    perm = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()  # shuffled, block 0 is scratch
    tables = []
    for n in lens:
        need = -(-n // block_size)
        tables.append([perm.pop() for _ in range(need)])
    meta = make_metadata(is_prefill=False, query_lens=[1] * len(lens), kv_lens=lens, block_tables=tables,
                         slot_mapping=list(range(len(lens))), device="cpu")  # fmt: skip
    # q as the model makes it: the first `heads` of a [B, heads + kv_heads, D] tensor (strided rows).
    q = torch.randn(len(lens), heads + kv_heads, head_dim, generator=g)[:, :heads]
    scale = head_dim**-0.5
    ref = TorchAttentionBackend().decode(q, k_cache, v_cache, meta, scale)
    out = TorchAttentionBackend(kernels).decode(q, k_cache, v_cache, meta, scale)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_batched_decode_with_paged_kernel_matches_transformers(llama_dir):
    """A batch above FUSED_MAX_BATCH through the module path with the kernel's attention."""
    from conftest import load_hf

    model, config = load_model(llama_dir, "float32", "cpu", backend=TorchAttentionBackend(kernels))
    h = PagedHarness(model, config)
    seqs = dict(enumerate(prompts(config.vocab_size, [5, 9, 2, 12, 1, 7, 3][: FUSED_MAX_BATCH + 1])))
    seen = greedy(h, seqs, steps=10)
    hf = load_hf(llama_dir)
    ref = {sid: hf_logits(hf, tokens) for sid, tokens in seqs.items()}
    for sid, pos, lg in seen:
        assert_close(lg, ref[sid][pos], f"batched kernel decode seq {sid} position {pos}")


def paged_reference(q, k_cache, v_cache, tables, lens, scale, window):
    """softmax(scale * q K^T) V per sequence in float64, over its last `window` keys (0: all)."""
    bs, kv_heads = k_cache.shape[1], k_cache.shape[2]
    out = torch.empty(q.shape, dtype=torch.float64)
    for b, n in enumerate(lens):
        ids = torch.tensor(tables[b])
        keys, values = (widen(c[ids].reshape(-1, kv_heads, c.shape[-1])[:n], torch.float64) for c in (k_cache, v_cache))
        first = n - window if 0 < window < n else 0
        group = q.shape[1] // kv_heads
        keys, values = (x[first:].repeat_interleave(group, dim=1) for x in (keys, values))
        p = torch.softmax(torch.einsum("hd,thd->ht", q[b].double(), keys) * scale, dim=-1)
        out[b] = torch.einsum("ht,thd->hd", p, values)
    assert bs > 0
    return out


# A few long sequences on two threads: attend_batch cuts each context into
# spans (paged_attention_spans.h: fewer than 4 sequences a thread, >= 64
# tokens a span) run as separate tasks and merged; windows cut the first span
# mid-block. The work is above kAttendParallelWork, so the threads do run.
# Caches: float32, bf16 (bf16 queries), fp8 and int8 rows with their scales.
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn, torch.int8])
@pytest.mark.parametrize("window", [0, 100, 777])
@pytest.mark.parametrize("lens", [[1900], [1800, 1, 333], [2000, 64, 65, 130]])
def test_paged_attention_split_contexts_match_reference(dtype, window, lens):
    heads, kv_heads, head_dim, block_size = 9, 3, 64, 16
    g = torch.Generator().manual_seed(sum(lens) + window)
    num_blocks = sum(-(-n // block_size) for n in lens) + 1
    k_cache, v_cache = (torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g) for _ in "kv")
    k_cache, v_cache = ((quantize_int8(c) if dtype == torch.int8 else c.to(dtype)) for c in (k_cache, v_cache))
    perm = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()
    tables = [[perm.pop() for _ in range(-(-n // block_size))] for n in lens]
    width = max(len(t) for t in tables)
    padded = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    q = torch.randn(len(lens), heads, head_dim, generator=g).to(torch.bfloat16 if dtype == torch.bfloat16 else
                                                                 torch.float32)  # fmt: skip
    scale = head_dim**-0.5
    ref = paged_reference(q, k_cache, v_cache, tables, lens, scale, window)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        out = kernels.paged_attention(q, k_cache, v_cache, padded, torch.tensor(lens, dtype=torch.int32), scale,
                                      window)  # fmt: skip
    finally:
        torch.set_num_threads(threads)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol)
