"""The fused decode layer over GGUF blocks (models/fused_decode.GGUFFusedDecoder, cpu_kernels/csrc/
decode/decode_gguf.cpp) against the module path on the same loaded model, per quantized type and
layer shape (Llama; Qwen2's biases; Qwen3's q/k norms; Gemma 3's four norms, q/k norms, GELU,
windowed layers on their own rotary).

Both paths run the same linears (QuantKernel's int8 sums over the same prepared blocks, the
activations quantized as ggml does); they differ in the float32 arithmetic between the linears
(reduction order of norms, softmax, residual adds), and an activation that lands on the other
side of an int8 rounding boundary moves a linear's output by a quantization step. So the logits
are compared as test_gguf_archs compares the kernels with the torch reference, on the whole
vector (cosine similarity and mean error against the mean |logit|), and the greedy tokens must
agree (measured: most variants bit-identical; the worst, Q5_1 Llama and Q6_K Gemma, cosine 0.99995
and 0.3% mean error where one rounding flipped). Three sequences of different lengths decode together (and one alone), past Gemma's
5-token window.
"""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as T
from test_gguf_archs import GEMMA, K, L, VARIANTS, q4_k_m, write_variant
from test_model import PagedHarness, prompts

from pagemill.models.fused_decode import GGUFFusedDecoder
from pagemill.models.loader import load_model

GEMMA3 = dict(**GEMMA, layer_types=["sliding_attention", "sliding_attention", "full_attention"],
              rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                               "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0}})  # fmt: skip
GEMMA3_K = {**GEMMA3, "head_dim": 64, "query_pre_attn_scalar": 64, **K}
FUSED = {
    "llama": VARIANTS["llama"],  # Q8_0
    "llama_q4_k_m": VARIANTS["llama_q4_k_m"],  # Q4_K, Q6_K (attn_v, ffn_down), Q8_0 tied head
    "mistral": VARIANTS["mistral"],  # Q4_0
    "qwen2": VARIANTS["qwen2"],  # Q4_1, q/k/v biases
    "qwen3": VARIANTS["qwen3"],  # Q5_0, q/k norms, biases
    "llama_q5_1": ("LlamaConfig", dict(**L), T.Q5_1, "gpt2"),
    "llama_q5_k": ("LlamaConfig", dict(**L, **K), T.Q5_K, "gpt2"),
    "gemma3_q8_0": ("Gemma3TextConfig", GEMMA3, T.Q8_0, "gemma"),
    "gemma3_q4_k_m": ("Gemma3TextConfig", GEMMA3_K, q4_k_m, "gemma"),
    "gemma3_q6_k": ("Gemma3TextConfig", GEMMA3_K, T.Q6_K, "gemma"),
}  # fmt: skip
NOT_FUSED = {
    "gemma2": VARIANTS["gemma2"],  # attention-logit softcapping: the layer has none
    "phi3": VARIANTS["phi3"],  # F16 linears: float rows, not blocks
    "qwen3_moe": VARIANTS["qwen3_moe"],  # expert MLPs
}


def _kernels_or_skip():
    from pagemill.cpu_kernels.decode import decode_kernels
    from pagemill.models.gguf.linear import quant_kernel

    if decode_kernels() is None or quant_kernel() is None:
        pytest.skip("compiled CPU kernels unavailable")


def _load(tmp_path, name, variants):
    _kernels_or_skip()
    _, path = write_variant(tmp_path, name, variants)
    model, config = load_model(str(path), "float32", "cpu", cpu_kernels=True)
    return model, config


def _decode_both(model, config, lengths, steps):
    """Greedy decode of len(lengths) sequences together, fused and module path (each its own pool)."""
    fused = model.model.fused
    seqs = dict(enumerate(prompts(config.vocab_size, lengths)))
    out = []
    for use in (fused, None):
        model.model.fused = use
        h = PagedHarness(model, config)
        cur = {i: list(t) for i, t in seqs.items()}
        last = h.prefill(cur)
        for i in cur:
            cur[i].append(int(last[i][-1].argmax()))
        logits = []
        for _ in range(steps):
            step = h.decode(cur)
            logits.append(torch.stack([step[i] for i in cur]))
            for i in cur:
                cur[i].append(int(step[i].argmax()))
        out.append((torch.stack(logits), cur))
    model.model.fused = fused
    return out


@pytest.mark.parametrize("name", list(FUSED))
def test_fused_layer_matches_module_path(name, tmp_path, monkeypatch):
    model, config = _load(tmp_path, name, FUSED)
    assert isinstance(model.model.fused, GGUFFusedDecoder), name
    calls = []
    real = GGUFFusedDecoder.__call__

    def counted(self, *a, **k):
        calls.append(1)
        return real(self, *a, **k)

    monkeypatch.setattr(GGUFFusedDecoder, "__call__", counted)
    for lengths in ([9, 4, 13], [6]):
        calls.clear()
        (a, toks_a), (b, toks_b) = _decode_both(model, config, lengths, steps=8)
        assert len(calls) == 8, name  # every decode step took the fused layer, none of the module path's
        cos = torch.nn.functional.cosine_similarity(a.flatten(1), b.flatten(1), dim=1).min().item()
        mean = ((a - b).abs().mean() / b.abs().mean()).item()
        assert cos > 0.999 and mean < 0.02, (name, lengths, cos, mean)
        assert toks_a == toks_b, name


@pytest.mark.parametrize("name", list(NOT_FUSED))
def test_shapes_the_layer_does_not_compute_keep_the_module_path(name, tmp_path):
    model, _ = _load(tmp_path, name, NOT_FUSED)
    assert model.model.fused is None, name


def test_larger_batches_take_the_module_path(tmp_path):
    model, config = _load(tmp_path, "llama", FUSED)
    fused = model.model.fused
    n = fused.max_batch + 1
    from pagemill.attention.metadata import make_metadata

    meta = make_metadata(is_prefill=False, query_lens=[1] * n, kv_lens=[3] * n, block_tables=[[1]] * n,
                         slot_mapping=list(range(16, 16 + n)), device="cpu")  # fmt: skip
    h = PagedHarness(model, config)
    assert not fused.applies(torch.zeros(n, config.hidden_size), meta, h.pool.kv_caches)
