"""A tiny Mistral whose every layer has a 12-token window, launched through
`pagemill launch` with 4-token blocks: greedy output equals transformers',
blocks behind the windows go back to the pool while requests run, and every
block is free afterwards."""

import json

import httpx
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


def test_blocks_go_back_while_a_long_request_runs(server):
    """/metrics read mid-stream: the request holds only the blocks its window covers, and the
    release counter moves before the request ends."""
    released_before = server.metric("pagemill_kv_window_released_blocks_total")
    body = {"inputs": " ".join(["word"] * 40), "parameters": {"max_new_tokens": 160, "ignore_eos": True}}
    seen, mid = 0, None
    with httpx.stream("POST", f"{server.url}/generate_stream", json=body, timeout=300) as r:
        for line in r.iter_lines():
            if not line.startswith("data:"):
                continue
            event = json.loads(line[5:])
            seen += 1
            if seen == 100:  # position ~140: 35 blocks of 4 without the window
                mid = (server.metric("pagemill_kv_window_released_blocks_total") - released_before,
                       server.metric("pagemill_kv_blocks_used"))
            last = event
    assert last["generated_text"] is not None and seen == 160
    released, used = mid
    # 12-token window over 4-token blocks: at most 4 blocks it reads, plus the one being filled.
    assert used <= 5, mid
    assert released >= 140 // 4 - 5, mid
