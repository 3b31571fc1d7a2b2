"""`--quantize int8` at small batch: the fused whole-layer decode over int8 weights
(cpu_kernels/csrc/decode/decode.cpp's Int8Linears, int8_rows.h) against the module path of the same
quantized model (QuantizedLinear per linear, torch ops around them).

Both paths quantize each linear's input rows per row and sum int8 x int8 in int32 with the
same kernel; they differ in what is rounded before quantizing: the fused layer keeps norms,
rotary, attention and the residual stream in float32, the module path in the model dtype. In
float32 that is summation order only, and an activation that lands on a rounding boundary now
and then; in bfloat16 the module path rounds every intermediate to bf16.

Each run: prefill, a late joiner after 6 steps, 20 greedy decode steps, batches 1..8, three
paths fed the same tokens in their own pools: the reference (the module path of the same int8
weights with float32 norms, embedding and pool: in float32 the model itself), the fused path
and the module path of the model under test. Asserted: the fused path took every decode step;
greedy tokens equal the reference's (TIE says where a near tie may go either way); relative max
logit error below REL_TOL; in bfloat16, the fused path (float32 intermediates) no further from the
reference than the bf16 module path over the run.
"""

from __future__ import annotations

import pytest
import torch
from test_fused_decode import Spy
from test_model import PagedHarness, prompts

from pagemill.cpu_kernels.build import build_library

from pagemill.cpu_kernels.decode import DecodeKernels, decode_kernels
from pagemill.models.fused_decode import FusedDecoder
from pagemill.models.loader import load_model

kernels = decode_kernels()
pytestmark = pytest.mark.skipif(kernels is None, reason="no C++ compiler / not x86-64 Linux")

# Relative max logit error per step (max |diff| / max |ref|) against the float32 module path of
# the same int8 weights. Measured on the six tiny variants, batches 1/4/8: float32 fused 3-5e-7
# (1.0e-2 once, an activation on a rounding boundary); bfloat16 fused 3.9-8.4e-2 (the bf16 module
# path 4.9-11.6e-2, its sum over the steps 1.1-1.3x the fused path's).
REL_TOL = {"float32": 2e-2, "bfloat16": 1e-1}
# Greedy tokens must be equal unless the reference's top two are within TIE (relative to its
# largest logit) of each other. float32: none seen. bfloat16 rounds the pool and embedding: on these
# rough random models both bf16 paths (fused and modules alike) pick the other of two tokens
# 0.1-3% apart now and then, so there a choice within the logit tolerance is allowed.
TIE = {"float32": 1e-2, "bfloat16": 1e-1}
LENGTHS = [6, 1, 9, 4, 13, 3, 7, 2]


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return ((ours.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


def float32_reference(model_dir: str, dtype: str):
    """The int8 model of `dtype` (same int8 weights and scales) with its norms and embedding
    widened to float32, exactly: its module path is the reference the bf16 paths are measured
    against (in float32 the model itself)."""
    ref, _ = load_model(model_dir, dtype, "cpu", quantize="int8")
    ref.float()  # leaves the int8/int32 tensors as they are
    ref.model.fused = None
    return ref


def compare_paths(model, ref_model, config, fused, batch: int, tie: float, steps: int = 20, join_at: int = 6):
    """Runs `batch` sequences (the last joins late) through `ref_model`'s module path (float32_reference:
    its greedy tokens feed all), `model`'s fused path and its
    module path. -> {"fused": [...], "module": [...]} of (relative errors per step, token
    mismatches beyond a near tie)."""
    dtype = model.model.embed_tokens.weight.dtype
    blocks = 96 + 8 * batch  # the 24-sequence case needs more than the harness's default
    harness = {"ref": PagedHarness(ref_model, config, blocks), "fused": PagedHarness(model, config, blocks, dtype=dtype),
               "module": PagedHarness(model, config, blocks, dtype=dtype)}  # fmt: skip
    run = {"ref": None, "fused": fused, "module": None}
    p = prompts(config.vocab_size, [LENGTHS[i % len(LENGTHS)] + 2 * (i // len(LENGTHS)) for i in range(batch)])
    seqs = {i: p[i] for i in range(max(batch - 1, 1))}
    late = {batch - 1: p[batch - 1]} if batch > 1 else {}
    found = {k: ([], []) for k in ("fused", "module")}

    def step(prefill: dict | None):
        outs = {}
        for k, h in harness.items():
            model.model.fused = run[k]
            outs[k] = h.prefill(prefill) if prefill else h.decode(seqs)
        return outs

    for sid, lg in step(seqs)["ref"].items():
        seqs[sid] = seqs[sid] + [int(lg[-1].argmax())]
    for i in range(steps):
        if i == join_at and late:
            for sid, lg in step(late)["ref"].items():
                seqs[sid] = late[sid] + [int(lg[-1].argmax())]
        outs = step(None)
        for sid in seqs:
            ref = outs["ref"][sid].float()
            top = int(ref.argmax())
            for k, (errs, mismatches) in found.items():
                errs.append(rel_err(outs[k][sid], ref))
                ours = int(outs[k][sid].argmax())
                # A different choice only counts where the reference did not see a near tie.
                if ours != top and ref[top] - ref[ours] > tie * ref.abs().max():
                    mismatches.append((i, sid, (ref[top] - ref[ours]).item()))
            seqs[sid] = seqs[sid] + [top]
    model.model.fused = fused
    return found


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
# 12: past the dense layers' 8 rows; 16: the team quantizes each input once (Int8Linears).
@pytest.mark.parametrize("batch", [1, 2, 4, 8, 12, 16])
def test_int8_fused_decode_matches_module_path(tiny_model, dtype, batch):
    name, model_dir, _ = tiny_model
    model, config = load_model(model_dir, dtype, "cpu", quantize="int8")
    fused = model.model.fused
    assert fused is not None and fused.int8 and fused.dtype == getattr(torch, dtype)
    assert fused.max_batch >= batch
    spy = Spy(fused)
    found = compare_paths(model, float32_reference(model_dir, dtype), config, spy, batch, TIE[dtype])
    assert spy.calls == 20, "every decode step takes the fused int8 layer"
    (errs, mismatches), (module_errs, _) = found["fused"], found["module"]
    assert not mismatches, f"{name} {dtype} batch {batch}: greedy tokens differ at {mismatches}"
    assert max(errs) < REL_TOL[dtype], f"{name} {dtype} batch {batch}: {max(errs):.2e}"
    if dtype == "bfloat16":  # float32 intermediates: at least as close as the bf16 modules
        assert sum(errs) < sum(module_errs), (sum(errs), sum(module_errs))


@pytest.mark.parametrize("flags", [("-mno-avx512vnni",), ("-mno-avx512f",)], ids=["no-vnni", "no-avx512f"])
def test_int8_fused_layer_portable_build_matches_native(llama_dir, flags):
    """The portable loop (same integers) through the whole layer, against the native build."""
    lib = build_library(flags)
    assert lib is not None, f"kernel build with {flags} failed"
    model, config = load_model(llama_dir, "float32", "cpu", quantize="int8")
    native, other = model.model.fused, FusedDecoder.build(model, DecodeKernels(lib))
    assert native is not None and other is not None and other.int8
    a, b = PagedHarness(model, config), PagedHarness(model, config)
    seqs = dict(enumerate(prompts(config.vocab_size, [9, 3])))
    model.model.fused = None
    for sid, lg in a.prefill(seqs).items():
        b.prefill({sid: seqs[sid]})
        seqs[sid] = seqs[sid] + [int(lg[-1].argmax())]
    for _ in range(8):
        model.model.fused = native
        ref = a.decode(seqs)
        model.model.fused = other
        out = b.decode(seqs)
        for sid in seqs:  # same integer sums, same float32 order outside the linears
            torch.testing.assert_close(out[sid], ref[sid], rtol=1e-5, atol=1e-5)
            seqs[sid] = seqs[sid] + [int(ref[sid].argmax())]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_int8_fused_layer_rows_do_not_depend_on_the_batch(llama_dir, dtype):
    """24 sequences in one fused call (the team quantizes each linear's input once, rows shared)
    give each sequence the logits that three calls of 8 give it, bit for bit: every row's
    quantization, integer sums, norms and attention are its own."""
    model, config = load_model(llama_dir, dtype, "cpu", quantize="int8")
    fused = model.model.fused
    assert fused is not None and fused.max_batch >= 24
    spy = Spy(fused)
    blocks = 400
    a, b = PagedHarness(model, config, blocks, dtype=getattr(torch, dtype)), \
        PagedHarness(model, config, blocks, dtype=getattr(torch, dtype))  # fmt: skip
    seqs = dict(enumerate(prompts(config.vocab_size, [3 + 5 * i % 17 for i in range(24)])))
    model.model.fused = None
    for sid, lg in a.prefill(seqs).items():
        b.prefill({sid: seqs[sid]})
        seqs[sid] = seqs[sid] + [int(lg[-1].argmax())]
    model.model.fused = spy
    for _ in range(6):
        whole = a.decode(seqs)
        parts = {}
        for g in range(3):
            parts |= b.decode({sid: seqs[sid] for sid in range(8 * g, 8 * g + 8)})
        for sid in seqs:
            assert torch.equal(whole[sid], parts[sid]), f"sequence {sid}"
            seqs[sid] = seqs[sid] + [int(whole[sid].argmax())]
    assert spy.calls == 6 * 4, "every decode step takes the fused int8 layer"


def test_int8_fused_not_built_without_kernel(llama_dir):
    """--no-cpu-kernels (QuantizedLinear's torch reference): no fused layer, module path."""
    model, _ = load_model(llama_dir, "float32", "cpu", quantize="int8", cpu_kernels=False)
    assert model.model.fused is None
    model, _ = load_model(llama_dir, "float32", "cpu", quantize="int8")
    assert FusedDecoder.build(model, None) is None


# SmolLM2 with int8 activations is chaotic under rounding: its int8 module path's logits move
# 7-11% (relative max error) when one norm weight changes by one float32 ulp (measured; the float
# model moves 8e-7), since SmolLM2's outlier channels make one quantization step large and a
# flipped step propagates through 30 layers. The fused path's float32 summation order flips such
# steps now and then, so here the bound is that sensitivity, not a rounding bound: measured fused
# vs module path 4-18% per step in float32 (2 sequences, 20 steps).
DEFAULT_MODEL_TOL, DEFAULT_MODEL_TIE = 0.3, 0.1


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_int8_fused_on_default_model(default_model_dir, dtype):
    """SmolLM2 (GQA 9/3, 30 layers, trained weights): fused int8 against the int8 module path, one
    sequence and a late joiner, 20 steps: the same greedy tokens outside near ties, logits within the
    model's own rounding sensitivity, and (bf16) about as close to float32 as the bf16 modules."""
    model, config = load_model(str(default_model_dir), dtype, "cpu", quantize="int8")
    fused = model.model.fused
    assert fused is not None and fused.int8
    found = compare_paths(model, float32_reference(str(default_model_dir), dtype), config, fused, 2, DEFAULT_MODEL_TIE)
    (errs, mismatches), (module_errs, _) = found["fused"], found["module"]
    assert not mismatches, mismatches
    assert max(errs) < DEFAULT_MODEL_TOL, max(errs)
    if dtype == "bfloat16":  # measured 3.16 vs 3.04 summed over the run
        assert sum(errs) < 1.25 * sum(module_errs), (sum(errs), sum(module_errs))
