"""GGUF blocks in torch: dequant.py bit-identical to gguf-py for every supported type, the test
quantizers' k-quant layouts read back by gguf-py, and GGUFLinear: its torch reference path, its
kernel path (through a stand-in with the compiled kernels' API), and what a loaded model holds."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import build_model_dir
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize as gguf_dequantize
from gguf_quants import quantize
from gguf_vocab import byte_level_vocab
from gguf_writer import write_gguf
from test_model import PagedHarness, prompts

from pagemill.models.gguf import linear as gguf_linear
from pagemill.models.gguf.dequant import dequantize
from pagemill.models.gguf.linear import GGUFLinear, reference_linear
from pagemill.models.gguf.reader import GGUFModel
from pagemill.models.gguf.types import ALL_TYPES, SUPPORTED_TYPES
from pagemill.models.loader import load_model

# Byte offsets of each type's f16 scales inside a block (kept finite in random blocks).
F16_AT = {T.Q4_0: [0], T.Q4_1: [0, 2], T.Q5_0: [0], T.Q5_1: [0, 2], T.Q8_0: [0], T.Q2_K: [80, 82], T.Q3_K: [108],
          T.Q4_K: [0, 2], T.Q5_K: [0, 2], T.Q6_K: [208]}  # fmt: skip


def random_blocks(qtype: int, rows: int, k: int, seed: int = 0) -> np.ndarray:
    t = ALL_TYPES[qtype]
    raw = np.random.default_rng(seed).integers(0, 256, (rows, t.row_bytes(k)), dtype=np.uint8)
    if qtype in (T.F16, T.BF16):
        raw[:, 1::2] &= 0x3B if qtype == T.F16 else 0x3F  # no inf / nan
    elif qtype == T.F32:
        raw[:, 3::4] &= 0x3F
    else:
        blocks = raw.reshape(-1, t.type_size)
        for at in F16_AT[qtype]:
            blocks[:, at + 1] &= 0x3B
    return raw


@pytest.mark.parametrize("qtype", SUPPORTED_TYPES, ids=lambda q: ALL_TYPES[q].name)
def test_dequantize_bit_identical_to_gguf_py(qtype):
    k = 64 if ALL_TYPES[qtype].block_size == 1 else 512
    raw = random_blocks(qtype, 9, k)
    ref = gguf_dequantize(raw, T(qtype)).astype(np.float32).reshape(9, k)
    ours = dequantize(torch.from_numpy(raw), qtype).numpy()
    assert ours.shape == ref.shape and np.array_equal(ours.view(np.uint32), ref.view(np.uint32))


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q5_K, T.Q6_K, T.Q4_0, T.Q8_0], ids=lambda q: q.name)
def test_test_quantizers_round_trip(qtype):
    x = np.random.default_rng(1).standard_normal((8, 512)).astype(np.float32)
    back = gguf_dequantize(quantize(x, qtype), qtype).reshape(x.shape)
    bound = {T.Q4_K: 0.25, T.Q5_K: 0.12, T.Q6_K: 0.06, T.Q4_0: 0.3, T.Q8_0: 0.02}[qtype]
    assert np.abs(back - x).max() < bound * np.abs(x).max()


def test_reference_linear_in_chunks_and_dtypes(monkeypatch):
    raw = torch.from_numpy(random_blocks(T.Q4_K, 40, 256))
    w = dequantize(raw, T.Q4_K)
    x, bias = torch.randn(3, 256), torch.randn(40)
    whole = reference_linear(x, raw, T.Q4_K, bias)
    monkeypatch.setattr(gguf_linear, "CHUNK_VALUES", 256 * 7)  # 7 rows at a time
    assert rel_err(reference_linear(x, raw, T.Q4_K, bias), whole) < 1e-6
    assert rel_err(whole, F.linear(x, w, bias)) < 1e-6
    lin = GGUFLinear(raw, T.Q4_K, 256, bias.bfloat16())
    y = lin(x.bfloat16()[None])
    assert y.dtype == torch.bfloat16 and y.shape == (1, 3, 40)
    assert rel_err(y.float()[0], whole) < 2e-2


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def test_wrong_row_bytes_is_refused():
    with pytest.raises(ValueError, match=r"Q8_0 weight of 64 inputs needs uint8 \[N, 68\]"):
        GGUFLinear(torch.zeros(4, 34, dtype=torch.uint8), T.Q8_0, 64)


class _Prepared:
    def __init__(self, q: torch.Tensor, qtype: int) -> None:
        self.blocks, self.qtype = q.clone(), qtype  # a repacked copy of its own (the same bytes here)


class StandInKernel:
    """The compiled kernels' API (cpu_kernels/quant.py), computing with dequant.py."""

    def __init__(self) -> None:
        self.linears = 0

    def supports(self, qtype: int) -> bool:
        return qtype != T.Q4_1  # one type left to the torch path

    def prepare(self, q: torch.Tensor, qtype: int, in_features: int) -> _Prepared:
        assert q.dtype == torch.uint8 and q.shape[1] == ALL_TYPES[qtype].row_bytes(in_features)
        return _Prepared(q, qtype)

    def linear(self, x: torch.Tensor, w: _Prepared, bias=None) -> torch.Tensor:
        assert x.is_contiguous() and x.dtype in (torch.float32, torch.bfloat16)
        self.linears += 1
        return F.linear(x.float(), dequantize(w.blocks, w.qtype), bias)

    def embedding(self, ids: torch.Tensor, w: _Prepared, dtype: torch.dtype) -> torch.Tensor:
        return dequantize(w.blocks[ids], w.qtype).to(dtype)

    def dequantize(self, w: _Prepared) -> torch.Tensor:
        return dequantize(w.blocks, w.qtype)


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("kern")
    kw = dict(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    model_dir = build_model_dir(str(tmp / "hf"), "l", variants={"l": ("LlamaConfig", kw, {})})
    types = lambda name, shape: T.F32 if len(shape) < 2 else T.Q4_1 if "ffn_down" in name else T.Q8_0  # noqa: E731
    return write_gguf(model_dir, tmp / "m.gguf", byte_level_vocab(320), types)[0]


def test_kernel_path_and_fallback(tiny_gguf, monkeypatch):
    kernel = StandInKernel()
    monkeypatch.setattr(gguf_linear, "quant_kernel", lambda: kernel)
    tokens = prompts(320, [9])[0]
    ours, config = load_model(str(tiny_gguf), "float32", "cpu", cpu_kernels=True)
    torch_path, _ = load_model(str(tiny_gguf), "float32", "cpu", cpu_kernels=False)
    linears = [m for m in ours.modules() if isinstance(m, GGUFLinear)]
    on_kernel = [m for m in linears if m.prepared is not None]
    assert {m.type_name for m in on_kernel} == {"Q8_0"} and all(m.type_name == "Q4_1" for m in linears
                                                                if m.prepared is None)  # fmt: skip
    assert all(m.qweight.numel() == 0 for m in on_kernel)  # the kernel's copy replaced the file's rows
    assert ours.lm_head is ours.model.embed_tokens.table  # tied: one matrix
    assert ours.model.fused is None and ours.model.batched is None
    a = PagedHarness(ours, config).prefill({0: tokens})[0]
    b = PagedHarness(torch_path, config).prefill({0: tokens})[0]
    assert kernel.linears > 0 and torch.allclose(a, b, rtol=1e-5, atol=1e-5)


def test_loaded_model_holds_no_float_copy(tiny_gguf):
    model, _ = load_model(str(tiny_gguf), "bfloat16", "cpu", cpu_kernels=False)
    g = GGUFModel(tiny_gguf)
    matrices = sum(t.n_bytes for t in g.tensors.values() if len(t.shape) == 2)
    blocks = {id(m.qweight): m.qweight.nbytes for m in model.modules() if isinstance(m, GGUFLinear)}
    assert sum(blocks.values()) == matrices  # every matrix once, in its blocks (the tied head is the embedding)
    floats = [(n, p) for n, p in model.named_parameters()]
    assert all(p.dim() == 1 and p.dtype == torch.bfloat16 for _, p in floats), [n for n, p in floats if p.dim() != 1]
    assert sum(p.nbytes for _, p in floats) < matrices / 10


def compiled_kernel():
    """The compiled quant kernels (cpu_kernels/quant.py), or a skip where they are not built."""
    from pagemill.cpu_kernels.quant import QuantKernel

    kernel = gguf_linear.quant_kernel()
    if not isinstance(kernel, QuantKernel):
        pytest.skip("the compiled quant kernels are not built here")
    return kernel


# The compiled path quantizes each call's activations to int8 blocks (32 values; Q8_K's 256 for
# the K-quants) as ggml does, so it differs from the float reference by that rounding: per
# linear on Gaussian rows, about 0.5% (32-value blocks) to 0.9% (K-quants) of the largest output
# at most; LINEAR_TOL allows 2%. Through a tiny random model's two layers and tied head (seven
# linears in a row, no trained smoothness) it adds up to ~3% of the largest logit at most and
# ~2.6% on average; LOGITS_TOL / LOGITS_MEAN_TOL allow 6% / 4%. (Against a reference that rounds
# x the same way, the 32-value types agree within 4e-4: tests/test_quant_kernels.py checks ggml's
# arithmetic exactly.)
LINEAR_TOL, LOGITS_TOL, LOGITS_MEAN_TOL = 2e-2, 6e-2, 4e-2
KERNEL_TYPES = [T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q4_K, T.Q5_K, T.Q6_K]


@pytest.mark.parametrize("qtype", KERNEL_TYPES, ids=lambda q: q.name)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_compiled_linear_matches_torch_reference(qtype, dtype):
    from pagemill.cpu_kernels.quant import PreparedWeight, QuantKernel

    kernel = compiled_kernel()
    assert kernel.supports(qtype)
    raw = torch.from_numpy(random_blocks(qtype, 48, 512, seed=3))
    bias = torch.randn(48)
    lin = GGUFLinear(raw.clone(), qtype, 512, bias.to(dtype))
    assert lin.pack_weights() and lin.on_kernel
    assert isinstance(lin.kernel, QuantKernel) and isinstance(lin.prepared, PreparedWeight)
    if qtype not in (T.F32, T.F16, T.BF16):  # a repacked copy replaced the file's rows
        assert lin.qweight.numel() == 0 and lin.prepared.nbytes == raw.numel()
    x = torch.randn(2, 5, 512).to(dtype)
    ref = reference_linear(x.reshape(-1, 512).float(), raw, qtype, bias.to(dtype).float())
    y = lin(x)
    assert y.dtype == dtype and y.shape == (2, 5, 48)
    assert rel_err(y.float().reshape(-1, 48), ref) < LINEAR_TOL
    assert torch.equal(lin.dequantize(), dequantize(raw, qtype))  # the repacked blocks read back exactly


def test_compiled_kernels_run_the_model(tiny_gguf, monkeypatch):
    """Where the kernels are built, load_model puts every GGUF linear (and the tied head and the
    embedding) on them, forward calls them, and the logits match the torch reference path."""
    from pagemill.cpu_kernels.quant import QuantKernel

    kernel = compiled_kernel()
    calls = {"linear": 0, "embedding": 0}

    def counting(name):
        real = getattr(QuantKernel, name)

        def call(self, *args, **kwargs):
            calls[name] += 1
            return real(self, *args, **kwargs)

        return call

    monkeypatch.setattr(QuantKernel, "linear", counting("linear"))
    monkeypatch.setattr(QuantKernel, "embedding", counting("embedding"))
    ours, config = load_model(str(tiny_gguf), "float32", "cpu", cpu_kernels=True)
    linears = [m for m in ours.modules() if isinstance(m, GGUFLinear)]
    assert linears and all(m.on_kernel and m.kernel is kernel for m in linears)
    assert all(m.qweight.numel() == 0 for m in linears)  # Q8_0 and Q4_1: repacked copies only
    assert ours.lm_head is ours.model.embed_tokens.table and ours.lm_head.on_kernel
    torch_path, _ = load_model(str(tiny_gguf), "float32", "cpu", cpu_kernels=False)
    assert not any(m.on_kernel for m in torch_path.modules() if isinstance(m, GGUFLinear))
    tokens = prompts(320, [9])[0]
    h, r = PagedHarness(ours, config), PagedHarness(torch_path, config)
    a, b = h.prefill({0: tokens})[0], r.prefill({0: tokens})[0]
    assert calls["linear"] >= len(linears) and calls["embedding"] == 1
    for x, y in [(a, b), (h.decode({0: tokens + [5]})[0], r.decode({0: tokens + [5]})[0])]:  # prefill, a decode step
        assert rel_err(x, y) < LOGITS_TOL and ((x - y).abs().mean() / y.abs().mean()).item() < LOGITS_MEAN_TOL
