"""The residual add fused into the next RMSNorm (RMSNorm.add_and_norm, cpu_kernels/csrc/rowwise/norm.cpp).

Bit for bit what it replaces: torch's bf16 add (each sum rounded to bf16)
followed by the bf16 norm kernel, in the native build and in one with the
AVX-512 paths compiled out. And a decoder stack that leaves each residual add
to the next norm (vLLM's layout, models/llama.py) gives exactly the logits of
the layer-by-layer adds it replaced.
"""

from __future__ import annotations

import pytest
import torch
from test_model import PagedHarness, prompts

from pagemill.attention.torch_backend import TorchAttentionBackend
from pagemill.cpu_kernels.build import build_library
from pagemill.cpu_kernels.decode import decode_kernels
from pagemill.cpu_kernels.rowwise import NormKernel, norm_kernel
from pagemill.models.layers import RMSNorm
from pagemill.models.loader import load_model

native = norm_kernel()
pytestmark = pytest.mark.skipif(native is None, reason="no C++ compiler / not x86-64 Linux")


@pytest.fixture(scope="module", params=["native", "no-avx512bf16", "no-avx512f"])
def kernel(request):
    """no-avx512bf16: bf16 narrowing by integer arithmetic instead of vcvtneps2bf16 (vec.h)."""
    if request.param == "native":
        return native
    lib = build_library((f"-m{request.param}",))
    assert lib is not None
    return NormKernel(lib)


def rows(n: int, hidden: int, seed: int, strided: bool) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, hidden + 8, generator=g) * torch.logspace(-3, 3, n)[:, None]  # sums across exponents
    return x.bfloat16()[:, :hidden] if strided else x[:, :hidden].bfloat16().contiguous()


@pytest.mark.parametrize("n,hidden", [(1, 576), (16, 576), (64, 576), (3, 17), (300, 96), (5, 31)])
@pytest.mark.parametrize("strided", [False, True])
def test_add_norm_is_the_add_then_the_norm_bit_for_bit(kernel, n, hidden, strided):
    x, residual = rows(n, hidden, n + hidden, strided), rows(n, hidden, 7 * n, strided)
    weight = (torch.randn(hidden, generator=torch.Generator().manual_seed(hidden)) * 0.5 + 1).bfloat16()
    summed, normed = kernel.add(x, residual, weight, 1e-5)
    ref = residual + x  # torch's bf16 add
    assert summed.dtype == normed.dtype == torch.bfloat16 and summed.shape == normed.shape == (n, hidden)
    assert torch.equal(summed, ref)
    assert torch.equal(normed, kernel(ref, weight, 1e-5))


def test_add_norm_rounds_denormal_results_as_torch(kernel):
    """Sums and scaled outputs below 2^-126 (which vcvtneps2bf16 would flush to zero) as torch's ops."""
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(8, 64, generator=g) * 1e-38).bfloat16()
    residual = (torch.randn(8, 64, generator=g) * 1e-38).bfloat16()
    weight = (torch.randn(64, generator=g) * 1e-39).bfloat16()  # denormal weights: denormal outputs
    summed, normed = kernel.add(x, residual, weight, 1e-30)
    ref_sum = residual + x
    assert (ref_sum.float().abs() < 2**-126).sum() > 100  # the case is exercised
    assert torch.equal(summed.view(torch.int16), ref_sum.view(torch.int16))
    norm = RMSNorm(64, 1e-30).bfloat16()
    with torch.no_grad():
        norm.weight.copy_(weight)
    ref = norm(ref_sum)  # torch's casts (no kernel)
    assert ((ref != 0) == (normed != 0)).all()  # nothing flushed
    diff = (normed.float() - ref.float()).abs()
    assert (diff <= ref.float().abs() * 2**-7).all()  # at most the sum of squares' ulp


def test_rms_norm_add_and_norm_with_and_without_the_kernel():
    norm = RMSNorm(96, 1e-6).bfloat16()
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(0.5, 1.5, 96))
    x, residual = rows(9, 96, 1, True), rows(9, 96, 2, False)
    summed, normed = norm.add_and_norm(x, residual)  # no kernel: torch's ops
    assert torch.equal(summed, residual + x) and torch.equal(normed, norm(residual + x))
    norm.kernel = native
    k_summed, k_normed = norm.add_and_norm(x, residual)
    assert torch.equal(k_summed, summed) and torch.equal(k_normed, norm(summed))  # norm(): the kernel too
    f32 = RMSNorm(96, 1e-6)
    f32.kernel = native  # float32 rows: the kernel does not apply
    a, b = torch.randn(2, 96), torch.randn(2, 96)
    s, n = f32.add_and_norm(a, b)
    assert torch.equal(s, b + a) and torch.equal(n, f32(b + a))


def layer_by_layer(model, ids, positions, meta, kv_caches) -> torch.Tensor:
    """The decoder stack as it was: each layer adds both its residuals itself."""
    inner = model.model
    x = inner.embed_tokens(ids)
    cos, sin = inner.rotary.cos_sin(positions, x.dtype)
    for layer, kv_cache in zip(inner.layers, kv_caches, strict=True):
        x = x + layer.self_attn(layer.input_layernorm(x), cos, sin, meta, kv_cache)
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return inner.norm(x)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_residual_stream_layout_gives_the_same_logits(tiny_model, dtype):
    """Prefill and batched decode (past the fused layer) through the model, against the stack above
    on the same pool: identical hidden states."""
    name, model_dir, _ = tiny_model
    model, config = load_model(model_dir, dtype, "cpu", backend=TorchAttentionBackend(decode_kernels()))
    model.model.fused = None
    h = PagedHarness(model, config, dtype=dtype)
    seqs = dict(enumerate(prompts(config.vocab_size, [11, 4, 7, 9, 3, 6, 5, 8, 10, 2])))
    forward, seen = model.forward, []
    model.forward = lambda *a: seen.append((a, forward(*a))) or seen[-1][1]
    for step in range(3):
        logits = h.prefill(seqs) if step == 0 else h.decode(seqs)  # writes this step's k/v
        (ids, positions, meta, kv_caches), ours = seen[-1]
        meta.derived.clear()
        assert torch.equal(ours, layer_by_layer(model, ids, positions, meta, kv_caches)), name  # the same k/v again
        for sid, lg in logits.items():
            seqs[sid] = seqs[sid] + [int(lg.view(-1, lg.shape[-1])[-1].argmax())]
    assert len(seen) == 3
