"""The bfloat16 GEMM (cpu_kernels/csrc/gemm/gemm_bf16.h) and PackedLinear's use of it, against float64
references and torch's own bf16 linear.

- kernel vs float64 of the same bf16 inputs: within the output's bf16 rounding, for every tile
  remainder (1..70 rows), row chunks (300 rows), odd N and K (padding), strided rows, bias or
  not, one and two threads;
- the portable loops (AVX-512 or only AVX512-BF16 compiled out) agree the same way;
- PackedLinear takes it for bf16 at 2+ rows where the path rule says so, and the rule itself.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagemill.cpu_kernels.build import build_library
from pagemill.cpu_kernels.gemm import GemmBf16Kernel, gemm_bf16_kernel, pack_bf16
from pagemill.models.packed_linear import MATVEC_MAX_ROWS, PackedLinear, bf16_linear_path

kernel = gemm_bf16_kernel()
needs_kernel = pytest.mark.skipif(kernel is None, reason="no C++ compiler / not x86-64 Linux")
needs_fast = pytest.mark.skipif(kernel is None or not kernel.fast, reason="no AVX512-BF16 on this CPU")

# (rows, out_features, in_features): every remainder of the 6-row and 4x16-column tiles, odd N and
# K, the default model's shapes, more rows than one chunk.
SHAPES = [(1, 960, 576), (2, 576, 1536), (5, 33, 7), (6, 16, 4), (7, 577, 1537), (13, 3072, 576), (64, 960, 576),
          (70, 130, 64), (300, 200, 96), (3, 1, 2), (1, 1, 1)]  # fmt: skip


def _case(m: int, n: int, k: int, bias: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed + m * 7919 + n * 31 + k)
    x = torch.randn(m, k, generator=g).bfloat16()
    w = (torch.randn(n, k, generator=g) / k**0.5).bfloat16()
    b = torch.randn(n, generator=g).bfloat16() if bias else None
    return x, w, b


def _reference(x, w, b) -> torch.Tensor:
    y = x.double() @ w.double().T
    return y + b.double() if b is not None else y


def _assert_rounded(ours: torch.Tensor, ref: torch.Tensor) -> None:
    """ours (bf16) is ref (float64) rounded to bf16, give or take float32 summation: within one
    bf16 step (2^-8 relative) plus a little absolute slack for sums that cancel."""
    assert ours.dtype == torch.bfloat16 and ours.shape == ref.shape
    err = (ours.double() - ref).abs()
    bound = ref.abs() * 2.0**-8 + 1e-4
    assert bool((err <= bound).all()), f"max excess {(err - bound).max().item():.3g}"


@needs_kernel
@pytest.mark.parametrize("m,n,k", SHAPES)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("threads", [1, 2])
def test_matches_float64(m, n, k, bias, threads):
    x, w, b = _case(m, n, k, bias)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        ours = kernel(x, pack_bf16(w), b, n)
    finally:
        torch.set_num_threads(before)
    _assert_rounded(ours, _reference(x, w, b))


@needs_kernel
def test_strided_rows_and_column_slices():
    """Rows further apart than K (a slice of a wider tensor) are read in place; a non-unit
    column stride is refused by the wrapper."""
    x, w, b = _case(9, 100, 64, True)
    wide = torch.zeros(9, 80, dtype=torch.bfloat16)
    wide[:, 8:72] = x
    _assert_rounded(kernel(wide[:, 8:72], pack_bf16(w), b, 100), _reference(x, w, b))
    with pytest.raises(ValueError, match="unit stride"):
        kernel(torch.zeros(9, 128, dtype=torch.bfloat16)[:, ::2], pack_bf16(w), b, 100)
    with pytest.raises(ValueError, match="bfloat16"):
        kernel(x.float(), pack_bf16(w), b, 100)


needs_amx = pytest.mark.skipif(kernel is None or not kernel.amx, reason="no AMX-BF16 on this CPU (or not granted)")


@needs_amx
@pytest.mark.parametrize("m,n,k", [(4, 960, 576), (5, 960, 576), (16, 48, 32), (33, 130, 64), (47, 96, 64),
                                   (48, 960, 576), (63, 130, 64), (64, 3072, 576), (300, 200, 96)])  # fmt: skip
def test_amx_and_vdpbf16ps_builds_agree(m, n, k):
    """Where the tiles run (4+ rows, K % 32 == 0), a build without them (the vdpbf16ps tiles) and
    both against float64: each within one bf16 rounding (every row-tile and block remainder,
    pair- and row-major walks, 33-63 rows in two passes that share a row; the SwiGLU epilogue on
    tiles: test_swiglu_epilogue_...)."""
    lib = build_library(("-mno-amx-tile", "-mno-amx-bf16"))
    assert lib is not None
    vdp = GemmBf16Kernel(lib)
    assert vdp.fast and not vdp.amx
    x, w, b = _case(m, n, k, True)
    ref = _reference(x, w, b)
    _assert_rounded(kernel(x, pack_bf16(w), b, n), ref)
    _assert_rounded(vdp(x, pack_bf16(w), b, n), ref)


@needs_kernel
def test_zero_rows_and_non_finite_inputs():
    x, w, _ = _case(4, 20, 32, False)
    assert kernel(x[:0], pack_bf16(w), None, 20).shape == (0, 20)
    x[1, 3] = float("nan")
    x[2, 0] = float("inf")
    out = kernel(x, pack_bf16(w), None, 20)
    assert bool(out[1].isnan().all()) and not bool(out[2].isfinite().all())
    _assert_rounded(out[[0, 3]], _reference(x[[0, 3]], w, None))
    x, w, _ = _case(8, 40, 64, False)  # 4+ rows, K % 32 == 0: AMX's tiles where present
    x[5, 1] = float("nan")
    out = kernel(x, pack_bf16(w), None, 40)
    assert bool(out[5].isnan().all()) and bool(out[[0, 1, 2, 3, 4, 6, 7]].isfinite().all())


def test_pack_layout():
    """[N, K] -> [N/16][K/2][16][2]: element (n, k) at [n // 16, k // 2, n % 16, k % 2], zero padded."""
    w = torch.arange(17 * 5, dtype=torch.float32).view(17, 5).bfloat16()
    p = pack_bf16(w)
    assert p.shape == (2, 3, 16, 2)
    for n in range(17):
        for k in range(5):
            assert p[n // 16, k // 2, n % 16, k % 2] == w[n, k]
    assert p[1, :, 1:].abs().sum() == 0 and p[:, 2, :, 1].abs().sum() == 0


@needs_kernel
@pytest.mark.parametrize("flags", [("-mno-avx512f",), ("-mno-avx512bf16",)])
@pytest.mark.parametrize("m,n,k", [(1, 33, 7), (7, 577, 96), (64, 130, 64)])
def test_portable_build(flags, m, n, k):
    lib = build_library(flags)
    assert lib is not None
    portable = GemmBf16Kernel(lib)
    assert not portable.fast
    x, w, b = _case(m, n, k, True)
    _assert_rounded(portable(x, pack_bf16(w), b, n), _reference(x, w, b))


def test_path_rule():
    assert bf16_linear_path({"avx512_bf16"}, kernel_fast=True) == "kernel"
    assert bf16_linear_path({"avx512_bf16", "amx_bf16"}, kernel_fast=True) == "onednn"
    assert bf16_linear_path({"avx512_bf16", "amx_bf16"}, kernel_fast=True, kernel_amx=True) == "kernel"
    assert bf16_linear_path({"avx512_bf16"}, kernel_fast=False) == "onednn"
    assert bf16_linear_path({"amx_bf16"}, kernel_fast=True, asked="kernel") == "kernel"
    assert bf16_linear_path(set(), kernel_fast=False, asked="kernel") == "onednn"  # not built: nothing to ask for
    with pytest.raises(ValueError, match="auto, kernel or onednn"):
        bf16_linear_path(set(), True, asked="mkl")


@needs_fast
@pytest.mark.parametrize("asked", ["kernel", "onednn"])
def test_packed_linear_paths_agree_with_torch(asked):
    """Both bf16 paths give torch's bf16 linear within one bf16 rounding, at one row (matvec),
    decode batches and a prefill; the kernel's copy replaces oneDNN's (same memory)."""
    lin = PackedLinear(576, 960, bias=True).bfloat16()
    lin.pack(bf16_linear=asked)
    assert (lin.gemm is kernel) == (asked == "kernel")
    if asked == "kernel":
        assert lin.packed.shape == (60, 288, 16, 2)
    with torch.inference_mode():
        for rows in (MATVEC_MAX_ROWS, 2, 16, 64, 300):
            x = torch.randn(rows, 576).bfloat16()
            _assert_rounded(lin(x), _reference(x, lin.weight, lin.bias))
        x = torch.randn(1, 576).bfloat16().expand(3, 576)  # rows that overlap (stride 0) are copied first
        _assert_rounded(lin(x), _reference(x, lin.weight, lin.bias))


@needs_kernel
def test_no_cpu_kernels_keeps_onednn():
    lin = PackedLinear(64, 32, bias=False).bfloat16()
    lin.pack(cpu_kernels=False)
    assert lin.gemm is None
    x = torch.randn(5, 64).bfloat16()
    with torch.inference_mode():
        torch.testing.assert_close(lin(x), F.linear(x, lin.weight))


@needs_fast
def test_fused_layer_hands_over_earlier_when_the_gemm_runs(tmp_path):
    """With the GEMM behind the module path's linears, bf16 steps of more than
    FUSED_MAX_BATCH_BF16_GEMM sequences (FUSED_MAX_BATCH_BF16_AMX where it runs on AMX tiles) take
    the module path or the batched layer (measured faster); with oneDNN's, the fused layer keeps
    up to FUSED_MAX_BATCH_BF16."""
    from conftest import build_model_dir

    from pagemill.cpu_kernels.decode import decode_kernels
    from pagemill.models.fused_decode import (FUSED_MAX_BATCH_BF16, FUSED_MAX_BATCH_BF16_AMX,
                                              FUSED_MAX_BATCH_BF16_GEMM, FusedDecoder)
    from pagemill.models.loader import load_model
    from pagemill.models.packed_linear import pack_all

    model, _ = load_model(build_model_dir(str(tmp_path), "llama_gqa"), torch.bfloat16, "cpu")
    gemm_bound = FUSED_MAX_BATCH_BF16_AMX if kernel.amx else FUSED_MAX_BATCH_BF16_GEMM
    for asked, bound in (("kernel", gemm_bound), ("onednn", FUSED_MAX_BATCH_BF16)):
        pack_all(model, True, asked)
        fused = FusedDecoder.build(model, decode_kernels())
        assert fused is not None and fused.max_batch == min(bound, fused._kernels.layer_max_rows)


# (rows, intermediate, in_features) for the SwiGLU epilogue: tile remainders, the default model's
# gate_up (I = 1536, K = 576), one intermediate block, more rows than a chunk.
SWIGLU_SHAPES = [(1, 16, 64), (2, 48, 576), (5, 1536, 576), (7, 80, 96), (41, 48, 576), (64, 1536, 576), (300, 64, 32)]


@needs_fast
@pytest.mark.parametrize("m,i,k", SWIGLU_SHAPES)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("threads", [1, 2])
def test_swiglu_epilogue_equals_gemm_then_silu_mul(m, i, k, bias, threads):
    """One pass over the interleaved gate_up: bit for bit the GEMM's gate_up and then the
    separate silu * up kernel (the module path it replaces)."""
    from pagemill.cpu_kernels.gemm import interleave_swiglu, pack_swiglu
    from pagemill.cpu_kernels.rowwise import elementwise_kernels

    x, w, b = _case(m, 2 * i, k, bias, seed=5)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        gate_up = kernel(x, pack_bf16(w), b, 2 * i)
        ref = elementwise_kernels().silu_mul(gate_up)
        ours = kernel.swiglu(x, pack_swiglu(w), None if b is None else interleave_swiglu(b).contiguous())
    finally:
        torch.set_num_threads(before)
    assert torch.equal(ours, ref)
    # and within bf16 rounding of torch's own SwiGLU on the same bf16 gate_up
    g, u = gate_up.float().chunk(2, dim=-1)
    torch.testing.assert_close(ours.float(), F.silu(g) * u, rtol=2**-7, atol=1e-3)


@needs_fast
def test_swiglu_rejects_what_it_cannot_compute():
    x, w, _ = _case(4, 40, 64, False)  # I = 20: not whole 16-channel blocks
    from pagemill.cpu_kernels.gemm import pack_bf16 as pack

    with pytest.raises(ValueError, match="swiglu"):
        kernel.swiglu(x, pack(w), None)
    with pytest.raises(ValueError, match="features"):
        kernel.swiglu(x[:, :32], pack(torch.zeros(32, 64, dtype=torch.bfloat16)), None)


@needs_fast
def test_mlp_packs_gate_up_for_the_swiglu_epilogue(llama_dir):
    """A bf16 model's MLPs run gate_up + SiLU in one GEMM; --no-cpu-kernels keeps two passes; the
    output is the two-pass MLP's bit for bit."""
    from pagemill.models.layers import MLP
    from pagemill.models.loader import load_model

    model, config = load_model(llama_dir, "bfloat16", "cpu")
    mlps = [m for m in model.modules() if type(m) is MLP]
    assert mlps and all(m.swiglu is not None and m.gate_up_proj.gemm is None for m in mlps)
    x = torch.randn(9, config.hidden_size).bfloat16()
    with torch.no_grad():
        ours = mlps[0](x)
        swiglu, mlps[0].swiglu = mlps[0].swiglu, None
        mlps[0].gate_up_proj.pack()  # back to the plain GEMM copy
        ref = mlps[0](x)
    assert torch.equal(ours, ref)
    plain = load_model(llama_dir, "bfloat16", "cpu", cpu_kernels=False)[0]
    assert all(m.swiglu is None for m in plain.modules() if type(m) is MLP)


def _shares_fn():
    import ctypes

    lib = build_library()
    fn = lib.pagemill_gemm_bf16_shares
    vp, i64 = ctypes.c_void_p, ctypes.c_int64
    fn.restype = ctypes.c_int
    fn.argtypes = [vp, i64, vp, vp, vp, i64, i64, i64, i64, ctypes.c_int, ctypes.POINTER(ctypes.c_double),
                   ctypes.c_int]  # fmt: skip
    return fn


def _with_shares(x, packed, b, n_out, n_rows_w, cum, swiglu=False) -> torch.Tensor:
    """The kernel on a team of len(cum) - 1 threads splitting the blocks at `cum` (team_balance.h)."""
    import ctypes

    m, k = x.shape
    y = torch.full((m, n_out), float("nan"), dtype=torch.bfloat16)
    shares = (ctypes.c_double * len(cum))(*cum)
    rc = _shares_fn()(x.data_ptr(), k, packed.data_ptr(), 0 if b is None else b.data_ptr(), y.data_ptr(), n_out, m,
                      n_rows_w, k, int(swiglu), shares, len(cum) - 1)  # fmt: skip
    assert rc == 0
    return y


def _one_thread(fn, *args) -> torch.Tensor:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return fn(*args)
    finally:
        torch.set_num_threads(before)


# Thread 0's share of the blocks: none, a quarter, most, all; and three threads, one with none.
SHARES = [(0.0, 0.0, 1.0), (0.0, 0.25, 1.0), (0.0, 0.8, 1.0), (0.0, 1.0, 1.0), (0.0, 0.3, 0.3, 1.0)]


@needs_fast
@pytest.mark.parametrize("m,n,k", [(5, 48, 64), (64, 960, 576), (300, 200, 96), (2, 33, 32)])
@pytest.mark.parametrize("cum", SHARES)
def test_uneven_shares_give_the_bits_of_one_thread(m, n, k, cum):
    """However the adapted shares split the blocks (team_balance.h), every output is computed once,
    by one thread, with the same arithmetic: the one-thread call's bits, no output left unwritten."""
    x, w, b = _case(m, n, k, True)
    packed = pack_bf16(w)
    ours = _with_shares(x, packed, b, n, n, cum)
    assert torch.equal(ours, _one_thread(kernel, x, packed, b, n))


@needs_fast
@pytest.mark.parametrize("cum", SHARES)
def test_uneven_shares_keep_swiglu_pairs_whole(cum):
    from pagemill.cpu_kernels.gemm import pack_swiglu

    x, w, _ = _case(40, 2 * 96, 64, False)
    packed = pack_swiglu(w)
    ours = _with_shares(x, packed, None, 96, 2 * 96, cum, swiglu=True)
    assert torch.equal(ours, _one_thread(kernel.swiglu, x, packed, None))


def _update(cum, busy):
    import ctypes

    lib = build_library()
    fn = lib.pagemill_team_balance_update
    fn.restype = None
    fn.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_double), ctypes.POINTER(ctypes.c_double)]
    c = (ctypes.c_double * len(cum))(*cum)
    fn(len(cum) - 1, c, (ctypes.c_double * len(busy))(*busy))
    return list(c)


@needs_kernel
def test_the_slower_thread_gets_fewer_blocks_within_bounds():
    # Equal times keep the shares; thread 0 twice as slow: its share moves a quarter of the way
    # toward the third that would have finished with thread 1 (0.5 -> 0.4583).
    assert _update([0, 0.5, 1], [1.0, 1.0]) == pytest.approx([0, 0.5, 1])
    assert _update([0, 0.5, 1], [2.0, 1.0])[1] == pytest.approx(0.75 * 0.5 + 0.25 / 3)
    assert _update([0, 0.5, 1], [1.0, 2.0])[1] == pytest.approx(1 - (0.75 * 0.5 + 0.25 / 3))
    # A thread that keeps losing its core never drops below half an even share.
    cum = [0, 0.5, 1]
    for _ in range(50):
        cum = _update(cum, [100.0, 1.0])
    assert cum[1] == pytest.approx(0.25)
    # Nothing measured for a thread (no share, or no call): no change.
    assert _update([0, 0.4, 1], [0.0, 1.0]) == pytest.approx([0, 0.4, 1])
    # Three threads: rising, from 0 to 1, the slowest with the smallest share.
    c3 = _update([0, 1 / 3, 2 / 3, 1], [1.0, 3.0, 1.0])
    assert c3[0] == 0 and c3[3] == 1 and c3[0] < c3[1] < c3[2] < c3[3]
    assert c3[2] - c3[1] < c3[1] - c3[0]
