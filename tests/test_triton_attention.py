"""Triton paged-attention kernels against the torch reference backend.

On a CUDA machine the kernels run compiled on the GPU. Elsewhere they run in
the Triton interpreter on CPU tensors, which has to be chosen before triton
is imported (triton's own library functions are decorated at import time)
and stay on while kernels run, so it cannot be switched on for one module of
a pytest process. Without CUDA, test_kernels_in_interpreter reruns this file
in a child pytest with TRITON_INTERPRET=1; here the kernel tests skip.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys

import pytest
import torch

from pagemill.attention import flash_backend, kernels, triton_backend
from pagemill.attention.backend import select_backend
from pagemill.attention.metadata import make_metadata
from pagemill.attention.torch_backend import TorchAttentionBackend

ON_CUDA = torch.cuda.is_available()
IN_INTERPRETER = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cuda" if ON_CUDA else "cpu"
kernel_test = pytest.mark.skipif(
    not (ON_CUDA or IN_INTERPRETER), reason="no CUDA: runs in test_kernels_in_interpreter's TRITON_INTERPRET=1 child"
)
TOLERANCE = {torch.float32: 1e-3, torch.float16: 2e-2, torch.bfloat16: 2e-2}  # max abs error / max |reference|
BLOCK_SIZE = 16
KV_HEADS = 2


@pytest.mark.skipif(ON_CUDA or IN_INTERPRETER, reason="the kernel tests run in this process")
def test_kernels_in_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    child = subprocess.run([sys.executable, "-m", "pytest", __file__, "-q", "-p", "no:cacheprovider"],
                           env=env, capture_output=True, text=True, timeout=600)  # fmt: skip
    assert child.returncode == 0, child.stdout[-6000:] + child.stderr[-2000:]
    print(child.stdout.strip().splitlines()[-1])  # the child's summary, shown with -s/-rA


@pytest.fixture(autouse=True, scope="module")
def _interpreter_bf16_dot():
    """The interpreter keeps bf16 tensors as raw uint16 bits and its tl.dot
    multiplies those bits as integers (it widens only fp8). Widening bf16
    operands to fp32 first is what the GPU's bf16 MMA computes (exact
    products, fp32 accumulation), so bf16 kernels are testable on CPU."""
    if ON_CUDA or not IN_INTERPRETER:
        yield
        return
    import triton.language as tl
    from triton.runtime.interpreter import InterpreterBuilder

    original = InterpreterBuilder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        widen = lambda x: self.cast_impl(x, tl.float32) if x.dtype.scalar == tl.bfloat16 else x  # noqa: E731
        return original(self, widen(a), widen(b), d, input_precision, max_num_imprecise_acc)

    InterpreterBuilder.create_dot = create_dot
    yield
    InterpreterBuilder.create_dot = original


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


class Pool:
    """A one-layer pool filled through shuffled block tables (block 0 never used)."""

    def __init__(self, head_dim, ratio, dtype, seed=0, num_blocks=48, block_size=BLOCK_SIZE):
        self.g = torch.Generator().manual_seed(seed)
        self.heads, self.head_dim, self.dtype, self.block_size = KV_HEADS * ratio, head_dim, dtype, block_size
        shape = (num_blocks, block_size, KV_HEADS, head_dim)
        self.k_cache = torch.zeros(shape, dtype=dtype, device=DEVICE)
        self.v_cache = torch.zeros(shape, dtype=dtype, device=DEVICE)
        self.free = list(range(1, num_blocks))
        random.Random(seed).shuffle(self.free)

    def rand(self, *shape):
        return torch.randn(*shape, generator=self.g).to(device=DEVICE, dtype=self.dtype)

    def sequence(self, length):
        """(block table, slots, k, v) of a new sequence of `length` tokens."""
        table = [self.free.pop() for _ in range(-(-length // self.block_size))]
        slots = [table[p // self.block_size] * self.block_size + p % self.block_size for p in range(length)]
        return table, slots, self.rand(length, KV_HEADS, self.head_dim), self.rand(length, KV_HEADS, self.head_dim)

    def write(self, k, v, slots):
        slots = torch.tensor(slots, dtype=torch.int64, device=DEVICE)
        TorchAttentionBackend().write_kv(k, v, self.k_cache, self.v_cache, slots)

    def fp32(self):
        return self.k_cache.float(), self.v_cache.float()


def prefill_case(pool, shapes):
    """(q, k, v, meta) of a prefill whose sequences have (cached, new) tokens; prefixes already in the pool."""
    qs, ks, vs, tables, slots = [], [], [], [], []
    for cached, n in shapes:
        table, seq_slots, k, v = pool.sequence(cached + n)
        pool.write(k[:cached], v[:cached], seq_slots[:cached])
        qs.append(pool.rand(n, pool.heads, pool.head_dim)), ks.append(k[cached:]), vs.append(v[cached:])
        tables.append(table)
        slots += seq_slots[cached:]
    meta = make_metadata(is_prefill=True, query_lens=[n for _, n in shapes], kv_lens=[c + n for c, n in shapes],
                         block_tables=tables, slot_mapping=slots, device=DEVICE)  # fmt: skip
    return torch.cat(qs), torch.cat(ks), torch.cat(vs), meta


def decode_case(pool, lengths):
    """(q, meta) of one decode step; every sequence's keys (its new one included) in the pool."""
    tables, slots = [], []
    for length in lengths:
        table, seq_slots, k, v = pool.sequence(length)
        pool.write(k, v, seq_slots)
        tables.append(table), slots.append(seq_slots[-1])
    meta = make_metadata(is_prefill=False, query_lens=[1] * len(lengths), kv_lens=lengths, block_tables=tables,
                         slot_mapping=slots, device=DEVICE)  # fmt: skip
    return pool.rand(len(lengths), pool.heads, pool.head_dim), meta


# (cached prefix, new tokens): fresh prompts over several 64-query tiles, prefixes that
# end mid-block and on a block boundary, a 1-token suffix, lengths off the block size.
PREFILL_SHAPES = [(0, 70), (21, 30), (16, 5), (3, 1)]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# The interpreter needs ~1 s per prefill case: it covers every (dtype, ratio), and every
# (dtype, head_dim), in 9 cases instead of 18. CUDA runs the full product.
PREFILL_CASES = [(d, r, h) for d in DTYPES for r in (1, 3, 8) for h in (64, 128)
                 if ON_CUDA or (DTYPES.index(d) + r + h // 64) % 2 == 0]  # fmt: skip


@kernel_test
@pytest.mark.parametrize("dtype,ratio,head_dim", PREFILL_CASES, ids=str)
def test_prefill_matches_reference(dtype, ratio, head_dim):
    pool = Pool(head_dim, ratio, dtype)
    q, k, v, meta = prefill_case(pool, PREFILL_SHAPES)
    kernels.write_kv(k, v, pool.k_cache, pool.v_cache, meta.slot_mapping)
    out = kernels.paged_prefill(q, pool.k_cache, pool.v_cache, meta.block_tables, meta.cu_seqlens_q,
                                meta.context_lens, meta.max_seqlen_q, head_dim**-0.5)  # fmt: skip
    ref = TorchAttentionBackend().prefill(q.float(), k.float(), v.float(), *pool.fp32(), meta, head_dim**-0.5)
    assert out.dtype == dtype
    assert rel_error(out, ref) < TOLERANCE[dtype]


@kernel_test
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_prefill_short_suffixes(dtype):
    """Only suffixes of <= 16 tokens after long cached prefixes: the 16-row query tile."""
    pool = Pool(64, 3, dtype, seed=3)
    q, k, v, meta = prefill_case(pool, [(100, 16), (37, 2), (64, 9)])
    kernels.write_kv(k, v, pool.k_cache, pool.v_cache, meta.slot_mapping)
    out = kernels.paged_prefill(q, pool.k_cache, pool.v_cache, meta.block_tables, meta.cu_seqlens_q,
                                meta.context_lens, meta.max_seqlen_q, 0.125)  # fmt: skip
    ref = TorchAttentionBackend().prefill(q.float(), k.float(), v.float(), *pool.fp32(), meta, 0.125)
    assert rel_error(out, ref) < TOLERANCE[dtype]


# Block-aligned and not, a 1-token context, one long enough for several partitions.
DECODE_LENGTHS = [1, 16, 33, 150, 9]


@kernel_test
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("ratio", [1, 3, 8])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_decode_matches_reference(dtype, ratio, head_dim):
    pool = Pool(head_dim, ratio, dtype, seed=1)
    q, meta = decode_case(pool, DECODE_LENGTHS)
    ref = TorchAttentionBackend().decode(q.float(), *pool.fp32(), meta, head_dim**-0.5)
    # 64-token partitions: 150 keys split 3 ways and reduced; one partition of 256: no reduce.
    for partition in (64, 256):
        out = kernels.paged_decode(q, pool.k_cache, pool.v_cache, meta.block_tables, meta.context_lens,
                                   meta.max_seqlen_k, head_dim**-0.5, partition)  # fmt: skip
        assert out.dtype == dtype
        assert rel_error(out, ref) < TOLERANCE[dtype], partition


@kernel_test
@pytest.mark.parametrize("window,softcap", [(5, None), (40, None), (None, 3.0), (17, 3.0)], ids=str)
def test_window_and_softcap_match_reference(window, softcap):
    """Sliding windows (shorter than a query tile, and than a 64-key tile; a window
    leaves some rows of a tile nothing visible in its first key tiles) and Gemma 2's
    logit cap, prefill and decode (split into partitions and not) against the torch reference."""
    pool = Pool(64, 3, torch.float32, seed=5)
    q, k, v, meta = prefill_case(pool, PREFILL_SHAPES)
    kernels.write_kv(k, v, pool.k_cache, pool.v_cache, meta.slot_mapping)
    out = kernels.paged_prefill(q, pool.k_cache, pool.v_cache, meta.block_tables, meta.cu_seqlens_q,
                                meta.context_lens, meta.max_seqlen_q, 0.125, window, softcap)  # fmt: skip
    ref = TorchAttentionBackend().prefill(q, k, v, *pool.fp32(), meta, 0.125, window=window, softcap=softcap)
    assert rel_error(out, ref) < TOLERANCE[torch.float32]
    q, meta = decode_case(pool, DECODE_LENGTHS)
    ref = TorchAttentionBackend().decode(q, *pool.fp32(), meta, 0.125, window=window, softcap=softcap)
    for partition in (64, 256):
        out = kernels.paged_decode(q, pool.k_cache, pool.v_cache, meta.block_tables, meta.context_lens,
                                   meta.max_seqlen_k, 0.125, partition, window, softcap)  # fmt: skip
        assert rel_error(out, ref) < TOLERANCE[torch.float32], partition


def test_decode_partition_size():
    # Big batches fill the GPU without splitting.
    assert kernels.decode_partition_size(batch=64, kv_heads=8, max_kv_len=4096, num_sms=132) >= 4096
    # One long sequence: split until ~2 programs per SM (33 splits of 8 kv heads),
    # partitions of whole 64-key tiles, so rounding up may leave a split fewer.
    size = kernels.decode_partition_size(batch=1, kv_heads=8, max_kv_len=32768, num_sms=132)
    assert size % 64 == 0 and 32 <= -(-32768 // size) <= 33
    # Never below 256 tokens, never more than 64 partitions.
    assert kernels.decode_partition_size(batch=1, kv_heads=1, max_kv_len=1000, num_sms=132) >= 256
    assert -(-10**6 // kernels.decode_partition_size(batch=1, kv_heads=1, max_kv_len=10**6, num_sms=132)) <= 64


@kernel_test
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16], ids=str)
def test_write_kv_writes_exactly_the_reference_slots(cache_dtype):
    pool, ref = Pool(64, 1, cache_dtype, seed=4), Pool(64, 1, cache_dtype, seed=4)
    slots = torch.tensor(random.Random(0).sample(range(BLOCK_SIZE, 48 * BLOCK_SIZE), 37), device=DEVICE)
    # k/v as the model hands them over: in the pool's dtype, here row-strided views of a wider tensor.
    fused = pool.rand(37, 3, KV_HEADS, 64)
    k, v = fused[:, 1], fused[:, 2]
    kernels.write_kv(k, v, pool.k_cache, pool.v_cache, slots)
    TorchAttentionBackend().write_kv(k, v, ref.k_cache, ref.v_cache, slots)
    assert torch.equal(pool.k_cache, ref.k_cache) and torch.equal(pool.v_cache, ref.v_cache)


@kernel_test
def test_triton_backend_in_the_model():
    """A tiny GQA model (head_dim 24: masked lanes) through a fresh prefill, a cached-prefix
    prefill and decode steps crossing a block boundary: the same logits as with torch."""
    from pagemill.models.config import ModelConfig
    from pagemill.models.llama import LlamaForCausalLM
    from pagemill.shard.kv_pool import KVPool

    config = ModelConfig.from_dict(dict(model_type="llama", vocab_size=256, hidden_size=64, intermediate_size=128,
                                        num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=2,
                                        head_dim=24, eos_token_id=2))  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(DEVICE).eval().requires_grad_(False)
    for p in model.parameters():
        p.data.normal_(0.0, 0.15)  # HF's std 0.02 makes attention nearly uniform and hides position bugs

    def slot(table, pos):
        return table[pos // 4] * 4 + pos % 4

    def step(pool, ids, positions, **meta):
        meta = make_metadata(device=DEVICE, **meta)
        hidden = model(torch.tensor(ids, device=DEVICE), torch.tensor(positions, device=DEVICE), meta, pool.kv_caches)
        return model.compute_logits(hidden)

    prompt = [5, 17, 200, 3, 44, 9, 81, 120, 7, 60]
    tables = [[3, 1, 6, 2], [4, 7, 5]]  # blocks of 4; sequence 1 crosses into block 5 while decoding
    logits = {}
    for backend in (TorchAttentionBackend(), triton_backend.TritonAttentionBackend(DEVICE)):
        model.set_backend(backend)
        pool = KVPool.with_blocks(config, num_blocks=8, block_size=4, dtype=torch.float32, device=DEVICE)
        # Sequence 1's first 4 tokens were computed by an earlier request (its prefix is cached).
        step(pool, prompt[:4], list(range(4)), is_prefill=True, query_lens=[4], kv_lens=[4],
             block_tables=[[4]], slot_mapping=[16, 17, 18, 19])  # fmt: skip
        out = [step(pool, prompt + [1, 2, 3], list(range(10)) + [4, 5, 6], is_prefill=True,
                    query_lens=[10, 3], kv_lens=[10, 7], block_tables=tables,
                    slot_mapping=[slot(tables[0], p) for p in range(10)] + [28, 29, 30])[[9, 12]]]  # fmt: skip
        for i, token in enumerate((11, 12, 13)):
            pos = [10 + i, 7 + i]
            out.append(step(pool, [token, token], pos, is_prefill=False, query_lens=[1, 1],
                            kv_lens=[p + 1 for p in pos], block_tables=tables,
                            slot_mapping=[slot(t, p) for t, p in zip(tables, pos)]))  # fmt: skip
        logits[backend.name] = torch.stack(out)
    assert rel_error(logits["triton"], logits["torch"]) < 1e-4


class FakeFlashAttn:
    """flash_attn's two entry points in torch, as their docstrings define them (causal
    aligned bottom-right; a block_table makes k/v the paged cache). Checks how the flash
    backend calls them, not flash-attn itself; gpu_check.sh runs the real one."""

    def __init__(self):
        self.calls = []

    @staticmethod
    def _attend(q, k, v, scale):  # q [n, H, D], k/v [L, kvh, D]; the last query sees every key
        offset = k.shape[0] - q.shape[0]
        keys, queries = torch.arange(k.shape[0], device=q.device), torch.arange(q.shape[0], device=q.device)
        mask = keys[None, :] <= queries[:, None] + offset
        return torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1).float(), k.transpose(0, 1).float(), v.transpose(0, 1).float(), attn_mask=mask,
            scale=scale, enable_gqa=True).transpose(0, 1).to(q.dtype)  # fmt: skip

    @staticmethod
    def _paged(cache, table, length):
        return cache[table.long()].flatten(0, 1)[:length]

    def flash_attn_varlen_func(self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                               softmax_scale=None, causal=False, block_table=None):  # fmt: skip
        self.calls.append("varlen_paged" if block_table is not None else "varlen")
        assert causal
        out = torch.empty_like(q)
        for i in range(len(cu_seqlens_q) - 1):
            (qa, qb), (ka, kb) = cu_seqlens_q[i : i + 2].tolist(), cu_seqlens_k[i : i + 2].tolist()
            keys, values = (k[ka:kb], v[ka:kb]) if block_table is None else (
                self._paged(k, block_table[i], kb - ka), self._paged(v, block_table[i], kb - ka))  # fmt: skip
            out[qa:qb] = self._attend(q[qa:qb], keys, values, softmax_scale)
        return out

    def flash_attn_with_kvcache(self, q, k_cache, v_cache, cache_seqlens=None, block_table=None,
                                softmax_scale=None, causal=False):  # fmt: skip
        self.calls.append("kvcache_paged")
        lens = cache_seqlens.tolist()
        return torch.stack([
            self._attend(q[i], self._paged(k_cache, block_table[i], n), self._paged(v_cache, block_table[i], n),
                         softmax_scale) for i, n in enumerate(lens)])  # fmt: skip


@kernel_test
@pytest.mark.parametrize("block_size", [256, BLOCK_SIZE])
def test_flash_backend_dispatch(block_size):
    """Pool blocks of 256: flash-attn's paged paths. Smaller blocks (which flash-attn's paged
    kernels reject): fresh prompts through varlen on the packed k/v, the rest through Triton."""
    fake = FakeFlashAttn()
    backend = flash_backend.FlashAttentionBackend(fake, triton_backend.TritonAttentionBackend(DEVICE))
    pool = Pool(64, 3, torch.bfloat16, seed=5, num_blocks=8 if block_size == 256 else 48, block_size=block_size)
    for shapes in ([(0, 30), (0, 9)], [(0, 20), (40, 7)]):
        q, k, v, meta = prefill_case(pool, shapes)
        backend.write_kv(k, v, pool.k_cache, pool.v_cache, meta.slot_mapping)
        out = backend.prefill(q, k, v, pool.k_cache, pool.v_cache, meta, 0.125)
        ref = TorchAttentionBackend().prefill(q.float(), k.float(), v.float(), *pool.fp32(), meta, 0.125)
        assert rel_error(out, ref) < 2e-2
    q, meta = decode_case(pool, [5, 300] if block_size == 256 else [5, 130])
    out = backend.decode(q, pool.k_cache, pool.v_cache, meta, 0.125)
    assert rel_error(out, TorchAttentionBackend().decode(q.float(), *pool.fp32(), meta, 0.125)) < 2e-2
    expected = ["varlen_paged", "varlen_paged", "kvcache_paged"] if block_size == 256 else ["varlen"]
    assert fake.calls == expected


def test_select_backend_errors(monkeypatch, caplog):
    from pagemill.attention import backend

    monkeypatch.setattr(backend, "_LOGGED", set())  # earlier tests may have logged the choice already
    caplog.set_level("INFO", logger="pagemill.attention.backend")
    assert select_backend("auto", "cpu").name == "torch"
    assert select_backend("auto", "cpu").name == "torch"
    assert sum("attention backend" in r.getMessage() for r in caplog.records) == 1  # the choice is logged once
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(RuntimeError, match=r"'triton' needs a CUDA device .*TRITON_INTERPRET=1"):
        select_backend("triton", "cpu")
    monkeypatch.setitem(sys.modules, "flash_attn", None)  # as if flash-attn were not installed
    with pytest.raises(RuntimeError, match=r"'flash' needs .*the flash-attn package"):
        select_backend("flash", "cuda")
    with pytest.raises(RuntimeError, match=r"'flash' needs a CUDA device"):
        select_backend("flash", "cpu")
