"""A tiny Mistral whose every layer has a 12-token window, launched through
`pagemill launch` with 4-token blocks: greedy output equals transformers',
blocks behind the windows go back to the pool while requests run, and every
block is free afterwards."""

import pytest
from server import launch
from windowed_models import build, check_greedy_against_transformers


@pytest.fixture(scope="module")
def mistral_dir(tmp_path_factory, default_model_dir):
    return build(tmp_path_factory.mktemp("tiny-mistral"), default_model_dir, "MistralConfig",
                 num_hidden_layers=2, sliding_window=12)  # fmt: skip


@pytest.fixture(scope="module")
def server(mistral_dir):
    s = launch(str(mistral_dir), "--block-size", "4", "--max-input-tokens", "256", "--max-total-tokens", "512")
    yield s
    s.stop()


def test_greedy_matches_transformers_and_blocks_go_back(server, mistral_dir):
    check_greedy_against_transformers(server, mistral_dir)
    # Every sequence ran well past its 12-token window (3 blocks).
    assert server.metric("pagemill_kv_window_released_blocks_total") >= 16 * 4
    assert server.metric("pagemill_kv_blocks_used") == 0
