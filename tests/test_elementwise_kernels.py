"""The compiled bf16 element-wise ops (cpu_kernels/csrc/rowwise/elementwise.cpp) against the torch ops they replace.

SwiGLU's silu(gate) * up and rotary embedding, with and without AVX-512,
must give the bf16 results of Hugging Face's op-by-op modules: the same
roundings in the same order. The exp inside silu is a polynomial, so a rare
result may land one bf16 step away; rotary has no such freedom and must be
bit-identical.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagemill.cpu_kernels.build import build_library
from pagemill.cpu_kernels.rowwise import ElementwiseKernels, elementwise_kernels
from pagemill.models.layers import MLP, apply_rotary

native = elementwise_kernels()
pytestmark = pytest.mark.skipif(native is None, reason="no C++ compiler / not x86-64 Linux")


@pytest.fixture(scope="module", params=["native", "no-avx512bf16", "no-avx512f"])
def kernels(request):
    """no-avx512bf16: bf16 narrowing by integer arithmetic instead of vcvtneps2bf16 (vec.h)."""
    if request.param == "native":
        return native
    lib = build_library((f"-m{request.param}",))
    assert lib is not None
    return ElementwiseKernels(lib)


@pytest.mark.parametrize("rows,n", [(1, 1536), (7, 37), (48, 1536), (3, 16), (2, 5)])
def test_silu_mul_matches_torch(kernels, rows, n):
    g = torch.Generator().manual_seed(rows * 1000 + n)
    x = (torch.randn(rows, 2 * n, generator=g) * 4).bfloat16()
    x[0, :3] = torch.tensor([-100.0, 100.0, 0.0])  # exp's range ends, and silu(0)
    gate, up = x.chunk(2, dim=-1)
    ref, got = F.silu(gate) * up, kernels.silu_mul(x)
    assert got.dtype == torch.bfloat16 and got.shape == ref.shape
    # silu(-100) underflows: torch gives -4e-42, the kernel's clamped exp a few 1e-36; both are 0 to a model.
    err = (got.float() - ref.float()).abs() - 2**-7 * ref.float().abs()
    assert err.max().item() <= 1e-30  # never more than one bf16 step
    assert (got != ref).sum().item() <= 1 + 0.01 * ref.numel()  # and that only in rare ties


def test_silu_mul_reads_strided_rows(kernels):
    x = torch.randn(6, 64, generator=torch.Generator().manual_seed(3)).bfloat16()
    view = x[:, :32]  # rows 64 apart, 32 wide: gate 16, up 16
    gate, up = view.chunk(2, dim=-1)
    assert torch.equal(kernels.silu_mul(view), F.silu(gate) * up)


@pytest.mark.parametrize("tokens,heads,dim", [(1, 12, 64), (5, 12, 64), (48, 12, 64), (3, 4, 24), (2, 3, 128)])
def test_rotary_matches_torch_bit_for_bit(kernels, tokens, heads, dim):
    g = torch.Generator().manual_seed(tokens * 100 + heads)
    qkv = torch.randn(tokens, heads + 3, dim, generator=g).bfloat16()
    x = qkv[:, :heads]  # the q and k heads of the fused projection: token stride > heads * dim
    pos = torch.randint(0, 4000, (tokens,), generator=g).float()
    freqs = pos[:, None] / (10000 ** (torch.arange(0, dim, 2).float() / dim))
    emb = torch.cat((freqs, freqs), -1)
    cos, sin = emb.cos().bfloat16(), emb.sin().bfloat16()
    ref = apply_rotary(x, cos, sin)
    got = kernels.rotary(x, cos, sin)
    assert got.is_contiguous() and torch.equal(got, ref)
    assert torch.equal(apply_rotary(x, cos, sin, kernels), ref)  # the model's entry point takes it


def test_rotary_rounds_denormal_results_as_torch(kernels):
    """vcvtneps2bf16 flushes float32 denormals to zero; the kernels must round them as torch does."""
    g = torch.Generator().manual_seed(11)
    x = (torch.randn(4, 3, 64, generator=g) * 1e-38).bfloat16()  # products below 2^-126
    x[0, 0, :8] = torch.tensor([1e-39, -1e-39, 3e-40, 1e-45, 0.0, -0.0, float("nan"), 2.0])
    cos, sin = (torch.randn(4, 64, generator=g) * 0.7).bfloat16(), (torch.randn(4, 64, generator=g) * 0.7).bfloat16()
    ref, got = apply_rotary(x, cos, sin), kernels.rotary(x, cos, sin)
    assert (ref.float().abs() < 2**-126).sum() > 100  # the case is exercised
    assert torch.equal(got.view(torch.int16), ref.view(torch.int16))  # bits, NaN included


def test_rotary_refuses_a_layout_it_cannot_read():
    x = torch.randn(4, 64, 3).bfloat16().transpose(1, 2)  # heads not head_dim apart
    cos = sin = torch.ones(4, 64).bfloat16()
    with pytest.raises(ValueError):
        native.rotary(x, cos, sin)
    assert torch.equal(apply_rotary(x, cos, sin, native), apply_rotary(x, cos, sin))  # falls back to torch


def test_float32_keeps_torch():
    assert not native.applies(torch.ones(2, 4))
    mlp = MLP.__new__(MLP)
    assert MLP.kernels is None and getattr(mlp, "kernels", None) is None
