"""A tiny Gemma 3 (local layers with an 8-token window next to a global one)
launched through `pagemill launch`: greedy output equals transformers', every
block is free afterwards, and nothing is given back (a hybrid model keeps
every layer's blocks: docs/kv_cache.md)."""

import pytest
from server import launch
from windowed_models import build, check_greedy_against_transformers


@pytest.fixture(scope="module")
def gemma_dir(tmp_path_factory, default_model_dir):
    return build(tmp_path_factory.mktemp("tiny-gemma3"), default_model_dir, "Gemma3TextConfig",
                 num_hidden_layers=3, head_dim=16, query_pre_attn_scalar=24, sliding_window=8,
                 layer_types=["sliding_attention", "sliding_attention", "full_attention"])  # fmt: skip


@pytest.fixture(scope="module")
def server(gemma_dir):
    s = launch(str(gemma_dir), "--block-size", "4", "--max-input-tokens", "256", "--max-total-tokens", "512")
    yield s
    s.stop()


def test_greedy_matches_transformers(server, gemma_dir):
    check_greedy_against_transformers(server, gemma_dir)
    assert server.metric("pagemill_kv_window_released_blocks_total") == 0
    assert server.metric("pagemill_kv_blocks_used") == 0
