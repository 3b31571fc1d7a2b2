"""The GGUF quant kernels (cpu_kernels/quant.py, csrc/quant/) against gguf-py and numpy references.

- dequantize (repacked layout read back) equals gguf-py's gguf.quants.dequantize bit for bit;
- linear equals an independent numpy reference of ggml's arithmetic (activations quantized per
  row as ggml quantizes them, then products with the dequantized weights in float64) to float32
  rounding, and float64 x @ W^T within the bound the activations' rounding allows;
- the portable build (-DPAGEMILL_QUANT_PORTABLE) and 2 threads give the very same bits;
- embedding rows equal dequantize rows; bad inputs raise ValueError.

Weights: random bytes with explicit finite f16 scales (any bit pattern of quants is a valid block),
and for the 32-element types also gguf-py's quantize of random floats.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from pagemill.cpu_kernels.build import build_library  # noqa: E402
from pagemill.cpu_kernels.quant import GGML_TYPES, PreparedWeight, QuantKernel, quant_kernel  # noqa: E402

kernel = quant_kernel()
pytestmark = pytest.mark.skipif(kernel is None, reason="no C++ compiler / not x86-64 Linux")

LEGACY = [8, 2, 3, 6, 7]  # Q8_0, Q4_0, Q4_1, Q5_0, Q5_1
KQUANTS = [12, 13, 14]  # Q4_K, Q5_K, Q6_K
FLOATS = [0, 1, 30]  # F32, F16, BF16
QUANTIZED = LEGACY + KQUANTS
NAMES = {t: GGML_TYPES[t].name for t in GGML_TYPES}


def random_blocks(qtype: int, n: int, k: int, seed: int = 0) -> np.ndarray:
    """uint8 [n, row_bytes]: random quants, finite f16 scales (d, and m / dmin where the type has them)."""
    rng = np.random.default_rng(seed + 1000 * qtype + n + k)
    t = GGML_TYPES[qtype]
    if qtype in FLOATS:
        w = rng.standard_normal((n, k)).astype(np.float32)
        return gguf.quants.quantize(w, gguf.GGMLQuantizationType(qtype)).view(np.uint8).reshape(n, -1)
    nb = k // t.block_elems
    b = rng.integers(0, 256, size=(n, nb, t.block_bytes), dtype=np.uint8)
    scale = 0.05 if qtype in LEGACY else 0.002

    def half(s: float) -> np.ndarray:
        return (rng.standard_normal((n, nb)) * s).astype(np.float16).view(np.uint8).reshape(n, nb, 2)

    if qtype == 14:
        b[..., 208:210] = half(scale)
    else:
        b[..., 0:2] = half(scale)
        if qtype in (3, 7, 12, 13):
            b[..., 2:4] = half(scale)
    return b.reshape(n, -1)


def gguf_quantized(qtype: int, n: int, k: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed + 7 * qtype + n)
    w = rng.standard_normal((n, k)).astype(np.float32)
    return gguf.quants.quantize(w, gguf.GGMLQuantizationType(qtype)).reshape(n, -1)


def gguf_dequantize(raw: np.ndarray, qtype: int) -> np.ndarray:
    return gguf.quants.dequantize(raw, gguf.GGMLQuantizationType(qtype)).reshape(raw.shape[0], -1).astype(np.float32)


def prepare(raw: np.ndarray, qtype: int, k: int, kern: QuantKernel = kernel) -> PreparedWeight:
    return kern.prepare(torch.from_numpy(raw.copy()), qtype, k)


def ggml_activations(x: np.ndarray, qtype: int) -> tuple[np.ndarray, np.ndarray]:
    """x float32 [M, K] quantized as ggml's x86 paths do -> (int quants [M, K], per-element scale
    [M, K]) in float64: blocks of 32 with an f16 scale (Q8_0/Q8_1), or Q8_K's blocks of 256."""
    m, k = x.shape
    if qtype in KQUANTS:
        b = x.reshape(m, -1, 256)
        idx = np.abs(b).argmax(-1)[..., None]  # the first of the largest magnitude
        mx = np.take_along_axis(b, idx, -1)
        with np.errstate(divide="ignore"):
            iscale = np.where(mx != 0, np.float32(-127) / mx, np.float32(0)).astype(np.float32)
            d = np.where(mx != 0, np.float32(1) / iscale, np.float32(0)).astype(np.float32)
        q = np.clip(np.rint(b * iscale), -127, 127)
    else:
        b = x.reshape(m, -1, 32)
        amax = np.abs(b).max(-1, keepdims=True)
        with np.errstate(divide="ignore"):
            inv = np.where(amax != 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
        q = np.clip(np.rint(b * inv), -127, 127)
        d = (amax / np.float32(127)).astype(np.float16).astype(np.float32)
    scale = np.broadcast_to(d, b.shape).astype(np.float64)
    return q.reshape(m, k).astype(np.float64), scale.reshape(m, k)


def reference(x: np.ndarray, raw: np.ndarray, qtype: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(ggml's result in float64, a bound on its float32 rounding, float64 x @ W^T)."""
    w = gguf_dequantize(raw, qtype).astype(np.float64)
    exact = x.astype(np.float64) @ w.T
    if qtype in FLOATS:
        return exact, 1e-5 * (np.abs(x.astype(np.float64)) @ np.abs(w).T) + 1e-30, exact
    q, s = ggml_activations(x, qtype)
    xq = q * s
    return xq @ w.T, 2e-5 * (np.abs(xq) @ np.abs(w).T) + 1e-30, exact


def activation_bound(x: np.ndarray, raw: np.ndarray, qtype: int) -> np.ndarray:
    """|x - dequantized activations| <= scale / 2 per element: the most it can move x @ W^T."""
    w = np.abs(gguf_dequantize(raw, qtype).astype(np.float64))
    _, s = ggml_activations(x, qtype)
    return (np.abs(s) / 2) @ w.T


def rows_x(m: int, k: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed + m * 31 + k)
    x = torch.randn(m, k, generator=g) * 2
    x[0, : min(k, 32)] = 0.0  # an all-zero block (scale 0)
    if m > 1:
        x[1, 5] = 40.0  # an outlier sets its block's scale
    return x


@pytest.mark.parametrize("qtype", QUANTIZED + FLOATS, ids=lambda t: NAMES[t])
def test_dequantize_matches_gguf_py(qtype):
    k = 512
    for raw in [random_blocks(qtype, 21, k)] + ([gguf_quantized(qtype, 13, k)] if qtype in LEGACY else []):
        w = prepare(raw, qtype, k)
        assert w.nbytes == raw.size and w.out_features == raw.shape[0] and w.in_features == k
        ref = gguf_dequantize(raw, qtype)
        got = kernel.dequantize(w).numpy()
        assert np.array_equal(got.view(np.uint32), ref.view(np.uint32)), NAMES[qtype]


@pytest.mark.parametrize("qtype", [8, 7, 13, 14], ids=lambda t: NAMES[t])
def test_prepare_in_place_gives_the_same_bytes(qtype):
    """pagemill_quant_prepare with dst == src (repacking a writable buffer without a second copy)."""
    n, k = 19, 512
    raw = random_blocks(qtype, n, k, seed=13)
    t = torch.from_numpy(raw.copy())
    assert kernel._prepare(qtype, t.data_ptr(), t.data_ptr(), n, k, 2) == 0
    assert torch.equal(t, prepare(raw, qtype, k).data)


def _shapes(qtype: int) -> list[tuple[int, int]]:
    """(N, K): N never a multiple of the 8-row groups; K = 640 (Gemma 3's hidden size) for the
    32-element types."""
    return [(37, 512), (19, 640)] if qtype in LEGACY else [(37, 512), (11, 256)]


@pytest.mark.parametrize("qtype", QUANTIZED + FLOATS, ids=lambda t: NAMES[t])
def test_linear_matches_ggml_arithmetic(qtype):
    for n, k in _shapes(qtype):
        if qtype in FLOATS and k == 640:
            continue
        raw = random_blocks(qtype, n, k, seed=1)
        w = prepare(raw, qtype, k)
        for m in (1, 2, 7, 64, 300):
            x = rows_x(m, k)
            y = kernel.linear(x, w).double().numpy()
            ggml, tol, exact = reference(x.numpy(), raw, qtype)
            assert np.all(np.abs(y - ggml) <= tol), f"{NAMES[qtype]} {m}x{k} -> {n}: {np.abs(y - ggml).max()}"
            bound = tol + (0 if qtype in FLOATS else activation_bound(x.numpy(), raw, qtype))
            assert np.all(np.abs(y - exact) <= bound), f"{NAMES[qtype]} vs float64 at {m}x{k} -> {n}"


@pytest.mark.parametrize("qtype", LEGACY, ids=lambda t: NAMES[t])
def test_linear_on_gguf_quantized_weights(qtype):
    n, k = 45, 640
    raw = gguf_quantized(qtype, n, k)
    w = prepare(raw, qtype, k)
    x = rows_x(5, k, seed=3)
    y = kernel.linear(x, w).double().numpy()
    ggml, tol, _ = reference(x.numpy(), raw, qtype)
    assert np.all(np.abs(y - ggml) <= tol)


@pytest.mark.parametrize("qtype", [8, 6, 12, 14, 1], ids=lambda t: NAMES[t])
def test_bias_and_bfloat16_rows(qtype):
    n, k = 27, 512
    w = prepare(random_blocks(qtype, n, k, seed=2), qtype, k)
    x = rows_x(9, k, seed=5)
    bias = torch.randn(n)
    y32 = kernel.linear(x, w, bias)
    assert torch.equal(y32, kernel.linear(x, w) + bias)
    xb = x.bfloat16()
    yb = kernel.linear(xb, w, bias)
    assert yb.dtype == torch.bfloat16 and yb.shape == (9, n)
    assert torch.equal(yb, kernel.linear(xb.float(), w, bias).bfloat16())
    assert kernel.linear(x[0], w).shape == (n,) and kernel.linear(x.view(3, 3, k), w).shape == (3, 3, n)


@pytest.fixture(scope="module")
def portable():
    lib = build_library(("-DPAGEMILL_QUANT_PORTABLE",))
    if lib is None:
        pytest.skip("portable build failed")
    k = QuantKernel(lib)
    assert k.simd == 0
    return k


@pytest.mark.parametrize("qtype", QUANTIZED + FLOATS, ids=lambda t: NAMES[t])
def test_portable_build_and_threads_give_the_same_bits(portable, qtype):
    n, k = 29, 512
    raw = random_blocks(qtype, n, k, seed=4)
    w, wp = prepare(raw, qtype, k), prepare(raw, qtype, k, portable)
    assert torch.equal(w.data, wp.data)  # the same repacked bytes
    ids = torch.tensor([0, n - 1, 8, 3, 27, 27])
    assert torch.equal(kernel.embedding(ids, w), portable.embedding(ids, wp))
    threads = torch.get_num_threads()
    for m in (1, 3, 13):
        x = rows_x(m, k, seed=6)
        y = kernel.linear(x, w)
        assert torch.equal(y, portable.linear(x, wp)), f"{NAMES[qtype]} at {m} rows"
        torch.set_num_threads(2)
        try:
            assert torch.equal(y, kernel.linear(x, w))
        finally:
            torch.set_num_threads(threads)


@pytest.mark.parametrize("qtype", [2, 14, 0], ids=lambda t: NAMES[t])
def test_many_rows_on_two_threads(qtype):
    """600 rows: the team quantizes the activations, the rows come in several L2-sized chunks,
    and (float types) the columns in several chunks."""
    n, k, m = 150, 1024, 600
    raw = random_blocks(qtype, n, k, seed=11)
    w = prepare(raw, qtype, k)
    x = rows_x(m, k, seed=12)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        y, yb = kernel.linear(x, w), kernel.linear(x.bfloat16(), w)
    finally:
        torch.set_num_threads(threads)
    ggml, tol, _ = reference(x.numpy(), raw, qtype)
    assert np.all(np.abs(y.double().numpy() - ggml) <= tol)
    assert torch.equal(yb, kernel.linear(x.bfloat16().float(), w).bfloat16())


@pytest.mark.parametrize("qtype", QUANTIZED + FLOATS, ids=lambda t: NAMES[t])
def test_embedding_rows_equal_dequantize_rows(qtype):
    n, k = 43, 640 if qtype in LEGACY else 512
    w = prepare(random_blocks(qtype, n, k, seed=7), qtype, k)
    full = kernel.dequantize(w)
    ids = torch.tensor([[42, 0, 7], [8, 40, 42]])
    e = kernel.embedding(ids, w, torch.float32)
    assert e.shape == (2, 3, k) and torch.equal(e, full[ids])
    assert torch.equal(kernel.embedding(ids[0], w, torch.bfloat16), full[ids[0]].bfloat16())


def test_gemma_embedding_is_the_tied_head():
    """One Q8_0 [vocab, 640] matrix serves the lookup and the output head (Gemma 3's tied embedding)."""
    vocab, hidden = 1000, 640
    raw = gguf_quantized(8, vocab, hidden)
    w = prepare(raw, 8, hidden)
    h = kernel.embedding(torch.tensor([5, 999]), w)
    logits = kernel.linear(h, w)
    ggml, tol, _ = reference(h.numpy(), raw, 8)
    assert logits.shape == (2, vocab) and np.all(np.abs(logits.double().numpy() - ggml) <= tol)


def test_activations_quantized_as_ggml_does():
    """Ties round to even and a block's largest magnitude maps to +-127 (Q8_K: the first one)."""
    k = 256
    x = np.zeros((1, k), np.float32)
    x[0, :4] = [127.0, 0.5, 1.5, -2.5]  # scale 1: the halves are ties
    x[0, 32:36] = [-3.0, 3.0, 1.5, 0.0]
    x[0, 64] = 1e-3  # an f16-subnormal scale
    for qtype in (8, 12):
        raw = random_blocks(qtype, 8, k, seed=9)
        w = prepare(raw, qtype, k)
        y = kernel.linear(torch.from_numpy(x), w).double().numpy()
        ggml, tol, _ = reference(x, raw, qtype)
        assert np.all(np.abs(y - ggml) <= tol), NAMES[qtype]
    q, s = ggml_activations(x, 8)
    assert q[0, :4].tolist() == [127, 0, 2, -2] and s[0, 0] == 1.0
    q, _ = ggml_activations(x, 12)
    assert q[0, 0] == -127  # iscale = -127 / max


def test_supported_types_and_sizes():
    assert set(GGML_TYPES) == {0, 1, 2, 3, 6, 7, 8, 12, 13, 14, 30}
    for t, info in GGML_TYPES.items():
        assert kernel.supports(t)
        assert gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(t)] == (info.block_elems, info.block_bytes)
    assert not kernel.supports(10) and not kernel.supports(99)  # Q2_K, nonsense


def test_bad_inputs_raise_value_errors():
    raw = torch.from_numpy(random_blocks(2, 16, 256))
    w = kernel.prepare(raw, 2, 256)
    with pytest.raises(ValueError, match="Q2_K|type 10"):
        kernel.prepare(raw, 10, 256)
    with pytest.raises(ValueError, match="Q4_0.*shape"):
        kernel.prepare(raw, 2, 512)  # rows of 288 bytes expected
    with pytest.raises(ValueError, match="Q4_K.*multiple"):
        kernel.prepare(raw, 12, 100)
    with pytest.raises(ValueError, match="uint8"):
        kernel.prepare(raw.float(), 2, 256)
    with pytest.raises(ValueError, match=r"Q4_0 linear.*\(3, 128\)"):
        kernel.linear(torch.randn(3, 128), w)
    with pytest.raises(ValueError, match="float32/bfloat16"):
        kernel.linear(torch.ones(3, 256, dtype=torch.int32), w)
    with pytest.raises(ValueError, match="bias"):
        kernel.linear(torch.randn(3, 256), w, torch.randn(5))
    with pytest.raises(ValueError, match=r"ids \[16, -1\]"):
        kernel.embedding(torch.tensor([0, 16, -1]), w)
    with pytest.raises(ValueError, match="int64"):
        kernel.embedding(torch.tensor([0.0]), w)
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        kernel.embedding(torch.tensor([0]), w, torch.float16)


@pytest.mark.skipif(not os.environ.get("PAGEMILL_TEST_VNNI_EMULATION"), reason="set PAGEMILL_TEST_VNNI_EMULATION=1 (one more build)")
@pytest.mark.parametrize("qtype", QUANTIZED, ids=lambda t: NAMES[t])
def test_vnni_code_gives_the_same_bits(qtype):
    """The VNNI build's code (vpdpbusd emulated in AVX2 on machines without it) against this build."""
    lib = build_library(("-DPAGEMILL_QUANT_EMULATE_VNNI",))
    vnni = QuantKernel(lib)
    assert vnni.simd == 2
    n, k = 29, 512
    raw = random_blocks(qtype, n, k, seed=8)
    w, wv = prepare(raw, qtype, k), prepare(raw, qtype, k, vnni)
    for m in (1, 4, 13):
        x = rows_x(m, k, seed=10)
        assert torch.equal(kernel.linear(x, w), vnni.linear(x, wv)), f"{NAMES[qtype]} at {m} rows"
