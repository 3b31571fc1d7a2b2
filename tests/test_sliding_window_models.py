"""Sliding-window models against transformers, float32: Mistral (every layer
windowed), Qwen2 and Qwen3 with use_sliding_window / max_window_layers (only
the layers from max_window_layers on) and Phi-3 (every layer).

The windows (5 and 6 tokens) are far shorter than the test's sequences (7..33
tokens), so every sequence but the 1-token prompt runs past its window in
prefill or decode. The reference is transformers with attn_implementation
"eager" (conftest.load_hf), whose mask is create_sliding_window_causal_mask;
test_transformers_applies_the_window checks that it really slides for these
configs (the same weights with the window removed give other logits).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil

import pytest
import torch
from conftest import build_model_dir, load_hf
from test_model import check_prefill_and_decode, hf_logits, prompts

from pagemill.cpu_kernels.decode import decode_kernels
from pagemill.models.config import ModelConfig, all_layers_window
from pagemill.models.loader import load_model

LAYERS = dict(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
VARIANTS = {
    "mistral_window": ("MistralConfig", dict(**LAYERS, sliding_window=5), {}),
    # layer 0 global, layer 1 windowed
    "qwen2_window": ("Qwen2Config", dict(**LAYERS, use_sliding_window=True, sliding_window=6, max_window_layers=1,
                                         rope_theta=1000000.0), {}),  # fmt: skip
    "phi3_window": ("Phi3Config", dict(**LAYERS, sliding_window=5, pad_token_id=0), {}),
    # q/k norms (module path) with both layers windowed
    "qwen3_window": ("Qwen3Config", dict(**LAYERS, use_sliding_window=True, sliding_window=5, max_window_layers=0),
                     {}),  # fmt: skip
}
EXPECTED_WINDOWS = {"mistral_window": (5, 5), "qwen2_window": (None, 6), "phi3_window": (5, 5), "qwen3_window": (5, 5)}
FUSED = ("mistral_window", "qwen2_window", "phi3_window")  # Qwen3's q/k norms keep it off the fused layer


@pytest.fixture(scope="module", params=list(VARIANTS))
def window_model(request, tmp_path_factory):
    path = build_model_dir(str(tmp_path_factory.mktemp(request.param)), request.param, variants=VARIANTS)
    return request.param, path, load_hf(path)


@pytest.mark.parametrize("cpu_kernels", [True, False], ids=["kernels", "torch"])
def test_prefill_and_decode_match_transformers(window_model, cpu_kernels):
    """Batch of 4 prompts (7, 13, 1, 10 tokens), one joining after 6 of 20 decode steps."""
    name, path, hf = window_model
    model, config = load_model(path, "float32", "cpu", cpu_kernels=cpu_kernels)
    assert config.layer_windows == EXPECTED_WINDOWS[name]
    assert [layer.self_attn.sliding_window for layer in model.model.layers] == list(EXPECTED_WINDOWS[name])
    if cpu_kernels and decode_kernels() is not None:
        # The fused decode layer takes windowed Llama layers (Mistral, Qwen2, Phi-3) and applies the window.
        assert (model.model.fused is not None) == (name in FUSED)
    check_prefill_and_decode(name, path, hf, cpu_kernels)


def test_transformers_applies_the_window(window_model, tmp_path):
    """The reference is meaningful: without the window transformers' logits change past it."""
    name, path, hf = window_model
    unwindowed = str(tmp_path / "global")
    shutil.copytree(path, unwindowed)
    with open(os.path.join(unwindowed, "config.json")) as f:
        config = json.load(f)
    config["sliding_window"] = None
    config.pop("layer_types", None)
    with open(os.path.join(unwindowed, "config.json"), "w") as f:
        json.dump(config, f)
    (tokens,) = prompts(hf.config.vocab_size, [12], seed=4)
    windowed, glob = hf_logits(hf, tokens), hf_logits(load_hf(unwindowed), tokens)
    window = min(w for w in EXPECTED_WINDOWS[name] if w is not None)
    assert torch.equal(windowed[:window], glob[:window])
    assert (windowed[window:] - glob[window:]).abs().max() > 1e-3


def test_window_config_parsing():
    base = dict(vocab_size=10, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4)
    assert ModelConfig.from_dict({**base, "model_type": "mistral", "sliding_window": 4096}).layer_windows == (4096,) * 4
    assert ModelConfig.from_dict({**base, "model_type": "mistral", "sliding_window": None}).layer_windows == ()
    # Qwen2 writes a window but applies it only with use_sliding_window, from max_window_layers on.
    qwen = {**base, "model_type": "qwen2", "sliding_window": 32, "max_window_layers": 3}
    assert ModelConfig.from_dict(qwen).layer_windows == ()
    assert ModelConfig.from_dict({**qwen, "use_sliding_window": True}).layer_windows == (None, None, None, 32)
    # layer_types, where the config lists them, decide.
    types = ["sliding_attention", "full_attention"] * 2
    parsed = ModelConfig.from_dict({**qwen, "use_sliding_window": True, "layer_types": types})
    assert parsed.layer_windows == (32, None, 32, None) and parsed.window_of(1) is None and parsed.window_of(2) == 32
    # What the shard reports in Info.sliding_window: the router frees behind it only if every layer slides.
    assert all_layers_window(ModelConfig.from_dict({**base, "model_type": "mistral", "sliding_window": 64})) == 64
    assert all_layers_window(parsed) == 0 and all_layers_window(ModelConfig.from_dict(qwen)) == 0
    qwen_all = ModelConfig.from_dict({**qwen, "use_sliding_window": True, "max_window_layers": 0})
    assert all_layers_window(qwen_all) == 32
    with pytest.raises(ValueError, match="layer_types lists 2 layers"):
        ModelConfig.from_dict({**qwen, "use_sliding_window": True, "layer_types": types[:2]})
    with pytest.raises(ValueError, match="unsupported layer_types"):
        ModelConfig.from_dict({**qwen, "use_sliding_window": True, "layer_types": ["chunked_attention"] * 4})


def test_shard_accepts_repeated_ids_only_behind_the_window():
    """A model whose every layer slides gets blocks behind the window given back by the router,
    which may hand the same id to the request again: only the blocks still read must be distinct."""
    from pagemill.proto import pb
    from pagemill.shard.errors import ShardError
    from pagemill.shard.requests import Limits, check_step

    def step(table):
        new = pb.NewRequest(input_ids=list(range(3, 23)), parameters=pb.NextTokenChooserParameters(),
                            stopping_parameters=pb.StoppingCriteriaParameters(max_new_tokens=5))  # fmt: skip
        return pb.StepRequest(requests=[pb.ScheduledRequest(id=1, new_request=new, num_computed=19, num_tokens=1,
                                                            new_block_ids=table)])  # fmt: skip

    # Position 19 reads keys 12..19 through an 8-token window: blocks 3 and 4 of 4 tokens.
    windowed = Limits(block_size=4, num_blocks=32, vocab_size=64, device=torch.device("cpu"), sliding_window=8)
    (entry,) = check_step(step([7, 7, 9, 10, 11]), {}, windowed)
    assert entry.error is None
    unwindowed = dataclasses.replace(windowed, sliding_window=0)
    for table, lim in (([7, 8, 9, 10, 10], windowed), ([7, 7, 9, 10, 11], unwindowed)):
        with pytest.raises(ShardError, match="repeats a block id"):
            check_step(step(table), {}, lim)
