"""Qwen3 and Phi-3 (models/qwen3.py, models/phi3.py) against transformers, float32.

The same paged, mixed-length, late-joining batch as test_model's check, with
the compiled CPU kernels on and off (Qwen3's q/k norms keep it off the fused
decode layer; Phi-3 takes it). Phi-3's LongRoPE switches frequency sets past
original_max_position_embeddings; transformers switches per forward call, so
that variant is compared with HF's own cached, token-by-token generation
(the rule layers.RotaryEmbedding follows) instead of one no-cache forward.
"""

from __future__ import annotations

import pytest
import torch
from conftest import build_model_dir, load_hf
from test_model import PagedHarness, assert_close, check_prefill_and_decode, prompts

from pagemill.cpu_kernels.decode import decode_kernels
from pagemill.models.config import SUPPORTED_MODEL_TYPES, ModelConfig
from pagemill.models.loader import load_model
from pagemill.parallel.group import ParallelGroup

LAYERS = dict(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
HALF = 8  # head_dim // 2 of the phi3 variants (64 / 4 / 2): one LongRoPE factor per frequency

VARIANTS = {
    # head_dim 32 != 64 / 4, tied embeddings (Qwen3-0.6B style), no q/k/v bias
    "qwen3_head_dim_tied": ("Qwen3Config", dict(**LAYERS, head_dim=32, tie_word_embeddings=True,
                                                rope_theta=1000000.0), {}),  # fmt: skip
    # attention_bias: q/k/v and o_proj biases (HF's Qwen3 gives o_proj one too)
    "qwen3_bias": ("Qwen3Config", dict(**LAYERS, attention_bias=True), {}),
    # fused qkv_proj / gate_up_proj, default rope
    "phi3": ("Phi3Config", dict(**LAYERS, sliding_window=None, pad_token_id=0), {}),
    # LongRoPE with a 16-token original context: the test's sequences cross it
    "phi3_longrope": (
        "Phi3Config",
        dict(**LAYERS, sliding_window=None, pad_token_id=0, original_max_position_embeddings=16,
             rope_scaling=dict(type="longrope", short_factor=[1.0 + 0.25 * i for i in range(HALF)],
                               long_factor=[2.0 + 1.5 * i for i in range(HALF)])),
        {},
    ),  # fmt: skip
}
NO_CACHE_REFERENCE = ["qwen3_head_dim_tied", "qwen3_bias", "phi3"]
KERNELS = decode_kernels() is not None


@pytest.fixture(scope="module", params=list(VARIANTS))
def breadth_model(request, tmp_path_factory):
    path = build_model_dir(str(tmp_path_factory.mktemp(request.param)), request.param, variants=VARIANTS)
    return request.param, path, load_hf(path)


@pytest.mark.parametrize("cpu_kernels", [True, False], ids=["kernels", "torch"])
def test_prefill_and_decode_match_transformers(breadth_model, cpu_kernels):
    name, path, hf = breadth_model
    if name in NO_CACHE_REFERENCE:
        check_prefill_and_decode(name, path, hf, cpu_kernels)
    else:
        check_against_cached_generation(name, path, hf, cpu_kernels)


def test_fused_decode_only_where_it_computes_the_layer(breadth_model):
    """Phi-3 is the Llama layer: fused. Qwen3's q/k norms are not in the kernel: module path."""
    if not KERNELS:
        pytest.skip("no C++ compiler / not x86-64 Linux")
    name, path, _ = breadth_model
    model, _ = load_model(path, "float32", "cpu", cpu_kernels=True)
    assert (model.model.fused is not None) == name.startswith("phi3")


def test_bfloat16_tracks_float32_reference(breadth_model):
    """bf16 weights and pool (Phi-3 through the bf16 fused layer, Qwen3 through the modules)."""
    name, path, hf = breadth_model
    model, config = load_model(path, "bfloat16", "cpu")
    h = PagedHarness(model, config, dtype=torch.bfloat16)
    (tokens,) = prompts(config.vocab_size, [12], seed=9)
    ours = torch.cat([h.prefill({0: tokens})[0], h.decode({0: tokens + [5]})[0][None]])
    ref = hf(torch.tensor([tokens + [5]])).logits[0].float().detach()
    rel = ((ours - ref).abs().max() / ref.abs().max()).item()
    assert rel < 5e-2, f"{name} bf16: relative max error {rel:.2e}"


@torch.no_grad()
def hf_cached_logits(hf, tokens: list[int], prompt_len: int) -> torch.Tensor:
    """HF's generation path: the prompt in one forward, then one token per forward with the
    cache. Rows: next-token logits after each position from prompt_len - 1 on."""
    out = hf(torch.tensor([tokens[:prompt_len]]), use_cache=True)
    rows, cache = [out.logits[0, -1]], out.past_key_values
    for tok in tokens[prompt_len:-1]:
        out = hf(torch.tensor([[tok]]), cache=cache, use_cache=True)
        rows.append(out.logits[0, -1])
        cache = out.past_key_values
    return torch.stack(rows).float()


def check_against_cached_generation(name, model_dir, hf, cpu_kernels: bool) -> None:
    model, config = load_model(model_dir, "float32", "cpu", cpu_kernels=cpu_kernels)
    original = config.rope_scaling.original_max_position_embeddings
    h = PagedHarness(model, config)
    lengths = [7, 13, 1, 10]  # all within the original context, as HF's prefill needs for the per-position rule
    assert max(lengths) <= original
    seqs = dict(enumerate(prompts(config.vocab_size, lengths)))
    prefill = h.prefill(seqs)
    ours = {sid: [lg[-1]] for sid, lg in prefill.items()}
    for sid in seqs:
        seqs[sid] = seqs[sid] + [int(ours[sid][-1].argmax())]
    for _ in range(20):  # every sequence ends past the original context
        for sid, lg in h.decode(seqs).items():
            ours[sid].append(lg)
            seqs[sid] = seqs[sid] + [int(lg.argmax())]
    assert min(len(t) for t in seqs.values()) > original + 1
    for sid, tokens in seqs.items():
        ref = hf_cached_logits(hf, tokens, lengths[sid])
        assert_close(torch.stack(ours[sid]), ref, f"{name} seq {sid} (kernels {cpu_kernels})")


def test_phi3_tensor_parallel_slices_fused_checkpoint(tmp_path):
    """Each rank's qkv_proj rows are [its q heads | its k heads | its v heads] and its gate_up rows
    [its gate | its up] out of Phi-3's fused tensors: the same rows the unfused layout gives."""
    path = build_model_dir(str(tmp_path), "phi3", variants=VARIANTS)
    full, config = load_model(path, "float32", "cpu", cpu_kernels=False)
    d, inter = config.head_dim, config.intermediate_size
    nq, nkv = config.num_attention_heads, config.num_key_value_heads
    full_qkv = full.model.layers[1].self_attn.qkv_proj.weight
    full_gu = full.model.layers[1].mlp.gate_up_proj.weight
    for rank in range(2):
        group = ParallelGroup(rank, 2, "cpu", initialised=False)  # loading needs no collectives
        model, _ = load_model(path, "float32", "cpu", group=group, cpu_kernels=False)
        lay = model.layout
        q, kv, i = lay.heads.q, lay.heads.kv, lay.intermediate
        expect_qkv = torch.cat([
            full_qkv[q.start * d : q.end * d],
            full_qkv[(nq + kv.start) * d : (nq + kv.end) * d],
            full_qkv[(nq + nkv + kv.start) * d : (nq + nkv + kv.end) * d],
        ])  # fmt: skip
        expect_gu = torch.cat([full_gu[i.start : i.end], full_gu[inter + i.start : inter + i.end]])
        assert torch.equal(model.model.layers[1].self_attn.qkv_proj.weight, expect_qkv)
        assert torch.equal(model.model.layers[1].mlp.gate_up_proj.weight, expect_gu)
        assert q.size == 2 and kv.size == 1 and i.size == inter // 2


def _tp_steps(group: ParallelGroup, dirs: dict) -> dict:
    from test_parallel import _steps

    return {v: _steps(d, group) for v, d in dirs.items()}


def test_two_ranks_match_one_rank(tmp_path_factory):
    """Tensor parallelism end to end: q/k norms on each rank's heads, o_proj's bias added once,
    Phi-3's fused tensors sliced per rank (test_parallel's 2-process gloo harness)."""
    from test_parallel import _steps, run_ranks

    dirs = {v: build_model_dir(str(tmp_path_factory.mktemp(v)), v, variants=VARIANTS)
            for v in ("qwen3_bias", "phi3_longrope")}  # fmt: skip
    ranks = run_ranks(_tp_steps, dirs)
    for variant, model_dir in dirs.items():
        for step, (a, b, ref) in enumerate(zip(ranks[0][variant], ranks[1][variant], _steps(model_dir, None))):
            assert torch.equal(a, b), f"{variant} step {step}: ranks disagree"
            rel = ((a - ref).abs().max() / ref.abs().max()).item()
            assert rel < 1e-5, f"{variant} step {step}: 2 ranks vs 1 relative error {rel:.2e}"


BASE = dict(vocab_size=10, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4)


def test_unknown_model_type_lists_supported_ones():
    with pytest.raises(ValueError) as err:
        ModelConfig.from_dict({**BASE, "model_type": "falcon"})
    assert "unsupported model_type 'falcon'" in str(err.value)
    for t in ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3_text"):
        assert t in SUPPORTED_MODEL_TYPES and t in str(err.value)


def test_qwen3_and_phi3_config_flags():
    q = ModelConfig.from_dict({**BASE, "model_type": "qwen3", "head_dim": 128, "sliding_window": 4096})
    assert q.qk_norm and not q.attention_bias and not q.o_proj_bias and q.head_dim == 128
    assert q.sliding_window is None  # only with use_sliding_window, as Qwen2
    qb = ModelConfig.from_dict({**BASE, "model_type": "qwen3", "attention_bias": True})
    assert qb.attention_bias and qb.o_proj_bias
    p = ModelConfig.from_dict({**BASE, "model_type": "phi3", "attention_bias": True})
    assert not p.attention_bias and not p.o_proj_bias and not p.qk_norm


def test_phi3_longrope_config_as_shipped():
    """Phi-3-mini-128k's layout: legacy rope_scaling with "su"/"longrope", original context on top."""
    d = {**BASE, "model_type": "phi3", "max_position_embeddings": 131072, "original_max_position_embeddings": 4096,
         "rope_scaling": {"type": "su", "short_factor": [1.0] * HALF, "long_factor": [4.0] * HALF}}  # fmt: skip
    s = ModelConfig.from_dict(d).rope_scaling
    assert s.rope_type == "longrope" and s.original_max_position_embeddings == 4096 and s.factor == 32.0
    assert s.attention_factor == pytest.approx((1 + torch.log(torch.tensor(32.0)).item() / torch.log(
        torch.tensor(4096.0)).item()) ** 0.5)  # fmt: skip
    explicit = {**d, "rope_scaling": {**d["rope_scaling"], "attention_factor": 1.25}}
    assert ModelConfig.from_dict(explicit).rope_scaling.attention_factor == 1.25
    with pytest.raises(ValueError, match="short_factor/long_factor have 3/8 entries"):
        ModelConfig.from_dict({**d, "rope_scaling": {**d["rope_scaling"], "short_factor": [1.0] * 3}})
    with pytest.raises(ValueError, match="partial_rotary_factor=0.75"):
        ModelConfig.from_dict({**d, "partial_rotary_factor": 0.75})  # Phi-4-mini
