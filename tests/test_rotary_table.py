"""RotaryEmbedding's CPU table (models/layers.py): cos/sin gathered from rows computed once give
the same bits as computing them for the step's positions, for each kind of RoPE, across the
table's growth; and as transformers' own rotary embedding."""

import pytest
import torch
from transformers import LlamaConfig, Phi3Config

from pagemill.models.config import ModelConfig
from pagemill.models.layers import RotaryEmbedding

HALF = 8  # head_dim // 2 below


def _config(kind: str) -> ModelConfig:
    common = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=1,
                  max_position_embeddings=4096)  # fmt: skip
    if kind == "default":
        return ModelConfig.from_dict(LlamaConfig(**common, rope_theta=10000.0).to_dict())
    if kind == "llama3":
        scaling = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                       original_max_position_embeddings=64)  # fmt: skip
        return ModelConfig.from_dict(LlamaConfig(**common, rope_scaling=scaling).to_dict())
    scaling = dict(type="longrope", short_factor=[1.0 + 0.25 * i for i in range(HALF)],
                   long_factor=[2.0 + 1.5 * i for i in range(HALF)])  # fmt: skip
    return ModelConfig.from_dict(Phi3Config(**common, original_max_position_embeddings=16, sliding_window=None,
                                            pad_token_id=0, rope_scaling=scaling).to_dict())  # fmt: skip


@pytest.mark.parametrize("kind", ["default", "llama3", "longrope"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_table_rows_are_the_computed_values(kind, dtype):
    rope = RotaryEmbedding(_config(kind))
    steps = [torch.arange(40), torch.tensor([0, 15, 16, 17, 1023]), torch.tensor([3, 1024, 2047, 2048, 5000]),
             torch.randint(0, 6000, (300,)), torch.tensor([7])]  # fmt: skip
    sizes = []
    for positions in steps:
        cos, sin = rope.cos_sin(positions, dtype)
        ref_cos, ref_sin = rope._compute(positions, dtype)
        assert cos.dtype == sin.dtype == dtype and cos.shape == (len(positions), 2 * HALF)
        assert torch.equal(cos, ref_cos) and torch.equal(sin, ref_sin)
        sizes.append(rope._tables[dtype][0].shape[0])
    # Grown to the next power of two past the largest position, and never shrunk.
    assert sizes == [1024, 1024, 8192, 8192, 8192]


def test_empty_and_negative_positions():
    rope = RotaryEmbedding(_config("default"))
    cos, sin = rope.cos_sin(torch.tensor([], dtype=torch.int64), torch.bfloat16)
    assert cos.shape == sin.shape == (0, 2 * HALF)
    with pytest.raises(ValueError, match=">= 0"):
        rope.cos_sin(torch.tensor([3, -1]), torch.bfloat16)


def test_same_bits_as_transformers_llama():
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    hf_config = LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=1,
                            rope_theta=10000.0, max_position_embeddings=4096)  # fmt: skip
    hf = LlamaRotaryEmbedding(hf_config)
    rope = RotaryEmbedding(ModelConfig.from_dict(hf_config.to_dict()))
    positions = torch.tensor([0, 1, 100, 1500, 3000])
    x = torch.zeros(1, len(positions), 64, dtype=torch.bfloat16)
    hf_cos, hf_sin = hf(x, positions[None])
    cos, sin = rope.cos_sin(positions, torch.bfloat16)
    assert torch.equal(cos, hf_cos[0]) and torch.equal(sin, hf_sin[0])
