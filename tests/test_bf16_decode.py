"""bfloat16 on the CPU: the compiled kernels (cpu_kernels/, bf16_rows.h) and the model against transformers.

- kernels: bf16 matvec and paged attention against float32 torch on the same
  bf16 values, for each way to multiply (vdpbf16ps, widening), and the same
  through a library built with the AVX-512 paths compiled out (the portable
  fallback every CPU without them runs);
- model: logits of our bf16 model against transformers' bf16 model at
  prefill and 20 decode steps with a late joiner, through the fused layer
  (batch <= its threshold) and through the batched path (packed oneDNN
  linears + the in-place paged attention kernel).

Tolerances: a kernel output is within ~1 bf16 ulp (2^-8 relative) of
float32 arithmetic on the same bf16 inputs. A model's logits differ from
transformers' bf16 by bf16 rounding of intermediates (HF rounds every one,
the fused layer keeps them float32): relative max error (max |diff| / max
|ref|, per step) < BF16_REL_TOL against transformers bf16, and the worst
distance from transformers float32 at most 1.5x HF bf16's own. Measured on
these tiny random models (weights N(0, 0.15), far rougher than trained
ones): 2.2-4.0e-2 from HF bf16, while HF bf16 is 3.8-6.3e-2 from float32.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_fused_decode import Spy
from test_model import BLOCK_SIZE, PagedHarness, hf_logits, prompts

from pagemill.attention.metadata import make_metadata
from pagemill.attention.torch_backend import TorchAttentionBackend
from pagemill.cpu_kernels.build import build_library
from pagemill.cpu_kernels.decode import DecodeKernels, decode_kernels
from pagemill.cpu_kernels.matvec import MatvecKernel, matvec_kernel
from pagemill.models.fused_decode import FusedDecoder
from pagemill.models.loader import load_model

kernels = decode_kernels()
pytestmark = pytest.mark.skipif(kernels is None, reason="no C++ compiler / not x86-64 Linux")

BF16_REL_TOL = 6e-2
MULS = ["dpbf16", "widen"]
# Builds with the fast paths compiled out: widening without vdpbf16ps, and scalar C++.
FALLBACKS = [("-mno-avx512bf16",), ("-mno-avx512f",)]


@pytest.fixture(scope="module", params=[()] + FALLBACKS, ids=["native", "no-avx512bf16", "no-avx512f"])
def library(request):
    """(matvec, decode kernels) of the native build and of each fallback build."""
    if not request.param:
        return matvec_kernel(), kernels
    lib = build_library(request.param)
    assert lib is not None, f"kernel build with {request.param} failed"
    return MatvecKernel(lib), DecodeKernels(lib)


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return ((ours.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


@pytest.mark.parametrize("mul", MULS)
@pytest.mark.parametrize("rows", [1, 2, 5, 8])
@pytest.mark.parametrize("n,k", [(960, 576), (577, 1536), (7, 17), (3, 33)])
def test_bf16_matvec_matches_float32_linear(library, mul, rows, n, k):
    matvec, _ = library
    g = torch.Generator().manual_seed(rows * 1000 + n + k)
    x, w, b = (torch.randn(*s, generator=g).bfloat16() for s in ((rows, k), (n, k), (n,)))
    ref = F.linear(x.float(), w.float(), b.float())
    out = matvec(x, w, b, mul)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref, rtol=2**-7, atol=1e-3 * ref.abs().max().item())
    torch.testing.assert_close(matvec(x, w, None, mul).float(), ref - b.float(), rtol=2**-7,
                               atol=1e-3 * ref.abs().max().item())  # fmt: skip


# Shapes of the vectorised path (paged_attention_spans.h: chunks of <= 16 tokens of a
# block, so block sizes 4/5/8 too, value passes of up to 6/4/2/1 heads by head_dim split
# evenly, e.g. group 7 at head_dim 64 as 3 + 4, bf16 values widened as even/odd halves
# where head_dim is a multiple of 32, 300 tokens over many scattered blocks) and of its
# fallbacks (head_dim 16, 40: paged_attention.h's per-kv-head loop).
@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size",
                         [(4, 2, 16, 4), (9, 3, 64, 16), (6, 1, 40, 5), (14, 2, 128, 16), (8, 8, 96, 16),
                          (5, 1, 256, 8), (4, 1, 80, 16), (2, 2, 64, 16), (8, 4, 64, 16), (7, 1, 64, 16),
                          (8, 1, 64, 16), (12, 2, 64, 16), (6, 1, 128, 16), (10, 2, 32, 16)])  # fmt: skip
def test_bf16_paged_attention_matches_float32_reference(library, heads, kv_heads, head_dim, block_size):
    _, decode = library
    g = torch.Generator().manual_seed(heads * 100 + head_dim + block_size)
    lens = [1, block_size, block_size + 1, 37, 2 * block_size - 1, 300]
    num_blocks = sum(-(-n // block_size) for n in lens) + 1
    k_cache, v_cache = (torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g).bfloat16() for _ in "kv")
    perm = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()
    tables = [[perm.pop() for _ in range(-(-n // block_size))] for n in lens]
    meta = make_metadata(is_prefill=False, query_lens=[1] * len(lens), kv_lens=lens, block_tables=tables,
                         slot_mapping=list(range(len(lens))), device="cpu")  # fmt: skip
    q = torch.randn(len(lens), heads + kv_heads, head_dim, generator=g).bfloat16()[:, :heads]
    scale = head_dim**-0.5
    ref = TorchAttentionBackend().decode(q.float(), k_cache.float(), v_cache.float(), meta, scale)
    out = TorchAttentionBackend(decode).decode(q, k_cache, v_cache, meta, scale)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref, rtol=2**-7, atol=1e-2)


def decode_with_late_joiner(model, config, steps: int = 20, lengths=(7, 13, 1, 10)):
    """Prefill the first sequences, a late one after 6 steps, `steps` greedy decode steps; every
    (what, seq, first position, logits) seen, and the final sequences."""
    h = PagedHarness(model, config, dtype=torch.bfloat16)
    p = prompts(config.vocab_size, list(lengths))
    seqs = {i: p[i] for i in range(len(p) - 1)}
    late, join_at, seen = {len(p) - 1: p[-1]}, 6, []

    def record_and_extend(logits, what):
        for sid, lg in logits.items():
            lg = lg if lg.dim() == 2 else lg[None]
            seen.append((what, sid, len(seqs[sid]) - lg.shape[0], lg))
            seqs[sid] = seqs[sid] + [int(lg[-1].argmax())]

    record_and_extend(h.prefill(seqs), "prefill")
    for step in range(steps):
        if step == join_at:
            logits = h.prefill(late)
            seqs.update(late)
            record_and_extend(logits, "late prefill")
        record_and_extend(h.decode(seqs), f"decode step {step}")
    return seen, seqs


def check_against_transformers(name: str, model_dir: str, model, config) -> None:
    import transformers

    hf = {d: transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=d, attn_implementation="eager").eval()
          for d in (torch.bfloat16, torch.float32)}  # fmt: skip
    seen, seqs = decode_with_late_joiner(model, config)
    ref = {d: {sid: hf_logits(m, t) for sid, t in seqs.items()} for d, m in hf.items()}
    ours_fp = hf_fp = 0.0
    for what, sid, first, lg in seen:
        rows = slice(first, first + lg.shape[0])
        bf, fp = ref[torch.bfloat16][sid][rows], ref[torch.float32][sid][rows]
        err = rel_err(lg, bf)
        assert err < BF16_REL_TOL, f"{name} {what} seq {sid}: {err:.2e} from transformers bf16"
        ours_fp, hf_fp = max(ours_fp, rel_err(lg, fp)), max(hf_fp, rel_err(bf, fp))
    assert ours_fp < 1.5 * hf_fp, f"{name}: {ours_fp:.2e} from float32, HF bf16 {hf_fp:.2e}"
    assert sum(w.startswith("decode") for w, *_ in seen) == 3 * 20 + 14


@pytest.mark.parametrize("mul", MULS)
def test_bf16_fused_decode_matches_transformers(tiny_model, mul):
    name, model_dir, _ = tiny_model
    model, config = load_model(model_dir, "bfloat16", "cpu")
    fused = model.model.fused
    assert fused is not None and fused.dtype == torch.bfloat16
    # The kernel at 3 and 4 sequences, whatever this CPU's threshold (1 where the GEMM is on AMX
    # tiles: fused_decode.FUSED_MAX_BATCH_BF16_AMX).
    fused.max_batch = max(fused.max_batch, 4)
    fused.mul = mul
    spy = model.model.fused = Spy(fused)
    check_against_transformers(name, model_dir, model, config)
    assert spy.calls == 20  # batch 3, then 4: every decode step fused


@pytest.mark.parametrize("path", ["module", "batched"])
def test_bf16_batched_decode_matches_transformers(tiny_model, path):
    """Above the fused threshold: packed bf16 linears and the bf16 paged attention kernel, through
    the module path or the batched decoder's one call per layer (models/batched_decode.py)."""
    name, model_dir, _ = tiny_model
    model, config = load_model(model_dir, "bfloat16", "cpu", backend=TorchAttentionBackend(kernels))
    model.model.fused = None
    spy = None
    if path == "module":
        model.model.batched = None
    elif model.model.batched is None:
        pytest.skip("no batched decoder: the bf16 linears are oneDNN's on this CPU")
    else:
        spy = model.model.batched = Spy(model.model.batched)
    calls = []
    decode, prefill, write = kernels.paged_attention, kernels.prefill_attention, kernels.write_kv
    backend = model.backend
    backend.kernels = type("Counting", (), {
        "paged_attention": lambda self, *a: calls.append("decode") or decode(*a),
        "prefill_attention": lambda self, *a: calls.append("prefill") or prefill(*a),
        "write_kv_applies": staticmethod(kernels.write_kv_applies),
        "write_kv": lambda self, *a: calls.append("write") or write(*a)})()  # fmt: skip
    check_against_transformers(name, model_dir, model, config)
    # 20 decode steps and the 2 prefills (the first batch, the late joiner): all through the kernels,
    # or all through the batched layer, which writes and attends inside its own calls.
    decodes, prefills = (0, 0) if spy else (20, 2)
    assert calls.count("decode") == decodes * config.num_hidden_layers
    assert calls.count("prefill") == prefills * config.num_hidden_layers
    assert calls.count("write") == (prefills + decodes) * config.num_hidden_layers  # every step's keys and values
    assert spy is None or spy.calls == 22


def test_bf16_fused_layer_fallback_builds_match_native(llama_dir, library):
    """The whole layer from each build (native, no vdpbf16ps, no AVX-512) on the same cache."""
    _, decode = library
    model, config = load_model(llama_dir, "bfloat16", "cpu")
    native = model.model.fused
    other = FusedDecoder.build(model, decode)
    h = PagedHarness(model, config, dtype=torch.bfloat16)
    seqs = dict(enumerate(prompts(config.vocab_size, [9, 3])))
    for sid, lg in h.prefill(seqs).items():
        seqs[sid] = seqs[sid] + [int(lg[-1].argmax())]
    for _ in range(2 * BLOCK_SIZE):
        model.model.fused = native
        ref = h.decode(seqs)
        model.model.fused = other
        out = h.decode(seqs)  # rewrites the same slots with the same k/v up to rounding
        for sid in seqs:
            assert rel_err(out[sid], ref[sid]) < 1e-2
            seqs[sid] = seqs[sid] + [int(ref[sid].argmax())]


def test_bf16_fused_tracks_float32_on_default_model(default_model_dir):
    """SmolLM2 (GQA 9/3, 30 layers, trained weights): bf16 fused and bf16 module path against the float32
    model on the same tokens; the fused layer (float32 residual) is at least as close as the modules."""
    f32, config = load_model(str(default_model_dir), "float32", "cpu")
    bf16, _ = load_model(str(default_model_dir), "bfloat16", "cpu")
    fused = bf16.model.fused
    assert fused is not None
    h32, h16 = PagedHarness(f32, config, num_blocks=64), PagedHarness(bf16, config, num_blocks=64, dtype=torch.bfloat16)
    seqs = dict(enumerate(prompts(config.vocab_size, [21, 5])))
    h16.prefill(seqs)
    for sid, lg in h32.prefill(seqs).items():
        seqs[sid] = seqs[sid] + [int(lg[-1].argmax())]
    errs = {"fused": [], "module": []}
    for _ in range(6):
        ref = h32.decode(seqs)
        bf16.model.fused = None
        module = h16.decode(seqs)  # writes this step's k/v; the fused step rewrites them
        bf16.model.fused = fused
        out = h16.decode(seqs)
        for sid in seqs:
            errs["fused"].append(rel_err(out[sid], ref[sid]))
            errs["module"].append(rel_err(module[sid], ref[sid]))
            seqs[sid] = seqs[sid] + [int(ref[sid].argmax())]
    # Measured: fused 0.6-1.6e-2, module path 0.8-2.1e-2 (relative max error per step).
    assert max(errs["fused"]) < 3e-2, errs
    assert sum(errs["fused"]) < 1.2 * sum(errs["module"]), errs


@pytest.mark.parametrize("rows,hidden", [(1, 576), (64, 576), (3, 17), (300, 96)])
def test_bf16_rms_norm_kernel_matches_the_torch_casts(rows, hidden):
    from pagemill.cpu_kernels.rowwise import norm_kernel
    from pagemill.models.layers import RMSNorm

    g = torch.Generator().manual_seed(rows + hidden)
    norm = RMSNorm(hidden, 1e-5).bfloat16()
    with torch.no_grad():
        norm.weight.copy_(torch.randn(hidden, generator=g) * 0.5 + 1)
    x = (torch.randn(rows, hidden + 8, generator=g) * 3).bfloat16()[:, :hidden]  # strided rows
    ref = norm(x)  # torch: no kernel set
    norm.kernel = norm_kernel()
    assert norm.kernel is not None and norm.kernel.applies(x, norm.weight)
    out = norm(x)
    # The sum of squares is added in another order than torch's: at most one bf16 ulp apart, rarely.
    diff = (out.float() - ref.float()).abs()
    assert (diff <= ref.float().abs() * 2**-7 + 1e-6).all()
    assert (diff > 0).float().mean() < 0.01
