"""The compiled KV write (cpu_kernels/csrc/attention/kv_write.cpp) against the index_copy_ it replaces.

A layer's new keys and values go into their pool slots as the torch backend's
write_rows does: the same bytes in the same places, for pools in the model's
dtype; fp8 and int8 pools (a cast on the way) keep the torch path.
"""

from __future__ import annotations

import pytest
import torch

from pagemill.attention.kv_dtype import quantize_int8
from pagemill.attention.torch_backend import TorchAttentionBackend
from pagemill.cpu_kernels.build import build_library
from pagemill.cpu_kernels.decode import DecodeKernels, decode_kernels

native = decode_kernels()
pytestmark = pytest.mark.skipif(native is None, reason="no C++ compiler / not x86-64 Linux")


@pytest.fixture(scope="module", params=["native", "no-avx512f"])
def kernels(request):
    if request.param == "native":
        return native
    lib = build_library(("-mno-avx512f",))
    assert lib is not None
    return DecodeKernels(lib)


def qkv_rows(tokens: int, heads: int, kv_heads: int, dim: int, dtype: torch.dtype, seed: int):
    """k and v as the attention module hands them over: views into the fused projection's rows."""
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(tokens, heads + 2 * kv_heads, dim, generator=g).to(dtype)
    return qkv[:, heads : heads + kv_heads], qkv[:, heads + kv_heads :]


def pools(blocks: int, block_size: int, kv_heads: int, dim: int, dtype: torch.dtype):
    g = torch.Generator().manual_seed(blocks)
    return [torch.randn(blocks, block_size, kv_heads, dim, generator=g).to(dtype) for _ in range(2)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize("tokens,heads,kv_heads,dim", [(1, 9, 3, 64), (16, 9, 3, 64), (64, 9, 3, 64), (37, 4, 4, 24)])
def test_write_kv_matches_index_copy(kernels, dtype, tokens, heads, kv_heads, dim):
    k, v = qkv_rows(tokens, heads, kv_heads, dim, dtype, tokens)
    k_ref, v_ref = pools(20, 16, kv_heads, dim, dtype)
    k_got, v_got = k_ref.clone(), v_ref.clone()
    slots = torch.randperm(20 * 16, generator=torch.Generator().manual_seed(tokens))[:tokens]
    assert kernels.write_kv_applies(k, v, k_got, v_got, slots)
    kernels.write_kv(k, v, k_got, v_got, slots)
    k_ref.view(-1, kv_heads, dim).index_copy_(0, slots, k)
    v_ref.view(-1, kv_heads, dim).index_copy_(0, slots, v)
    assert torch.equal(k_got, k_ref) and torch.equal(v_got, v_ref)


def test_write_kv_refuses_a_slot_outside_the_pool():
    k, v = qkv_rows(3, 9, 3, 64, torch.bfloat16, 0)
    k_cache, v_cache = pools(2, 16, 3, 64, torch.bfloat16)
    before = k_cache.clone()
    for bad in (32, -1):
        with pytest.raises(IndexError):
            native.write_kv(k, v, k_cache, v_cache, torch.tensor([0, bad, 1]))
    assert torch.equal(k_cache[0, 1], before[0, 1])  # nothing written from the bad token on


def test_write_kv_applies_only_without_a_cast_and_to_rows_it_can_read():
    k, v = qkv_rows(4, 9, 3, 64, torch.bfloat16, 1)
    k_cache, v_cache = pools(4, 16, 3, 64, torch.bfloat16)
    slots = torch.arange(4)
    assert native.write_kv_applies(k, v, k_cache, v_cache, slots)
    fp8 = k_cache.to(torch.float8_e4m3fn)
    assert not native.write_kv_applies(k, v, fp8, fp8.clone(), slots)  # a cast: torch's path
    assert not native.write_kv_applies(k, v, k_cache, v_cache, slots.int())
    assert not native.write_kv_applies(k.transpose(1, 2), v.transpose(1, 2), k_cache, v_cache, slots)
    assert not native.write_kv_applies(k, v, k_cache[:, :8], v_cache[:, :8], slots)  # a pool that is a view


@pytest.mark.parametrize("pool_dtype", [torch.bfloat16, torch.float8_e4m3fn, torch.int8])
def test_backend_write_kv_same_with_and_without_kernels(pool_dtype):
    """The backend's write: the kernel where it applies, torch's casting write elsewhere; one result."""
    k, v = qkv_rows(16, 9, 3, 64, torch.bfloat16, 2)
    width = 68 if pool_dtype == torch.int8 else 64
    slots = torch.randperm(64, generator=torch.Generator().manual_seed(5))[:16]
    caches = {}
    for name, backend in (("torch", TorchAttentionBackend()), ("kernels", TorchAttentionBackend(native))):
        k_cache, v_cache = (torch.zeros(4, 16, 3, width, dtype=pool_dtype) for _ in range(2))
        backend.write_kv(k, v, k_cache, v_cache, slots)
        caches[name] = (k_cache, v_cache)
    for a, b in zip(caches["torch"], caches["kernels"]):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    if pool_dtype == torch.int8:  # the torch path's quantized rows, as written
        assert torch.equal(caches["torch"][0].view(-1, 3, 68)[slots], quantize_int8(k))
