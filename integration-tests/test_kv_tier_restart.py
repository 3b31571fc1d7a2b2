"""The disk KV tier survives a restart: a server started again with the same
--kv-offload-dir loads a 1,000-token prefix it computed before, instead of
computing it, and answers with the same greedy tokens (docs/kv_cache.md)."""

import os
import time

import httpx
import pytest

from server import launch
from test_kv_cache import system_prompt

ARGS = ("--max-batch-prefill-tokens", "2048", "--max-input-tokens", "1200", "--max-total-tokens", "1300",
        "--kv-cache-memory", "256MiB", "--block-size", "16")
BLOCK = 16


def greedy(server, prompt: str, n: int = 8) -> list[int]:
    r = httpx.post(f"{server.url}/generate", timeout=300,
                   json={"inputs": prompt, "parameters": {"max_new_tokens": n, "details": True}})
    assert r.status_code == 200, r.text
    return [t["id"] for t in r.json()["details"]["tokens"]]


def wait_for_files(directory, n: int, timeout: float = 60) -> int:
    """Blocks reach the disk after the reply (the next step saves them, a thread writes them)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        count = sum(name.endswith(".kv") for name in os.listdir(directory))
        if count >= n:
            return count
        time.sleep(0.2)
    return count


@pytest.mark.timeout(300)
def test_restart_loads_a_prefix_computed_before(default_model_dir, tmp_path):
    prefix = system_prompt(default_model_dir, 1000)
    prompt = f"{prefix}\nQuestion: which policy covers parcels left at depot 3?"
    kv_dir = tmp_path / "kv"
    tier = ("--kv-offload-dir", str(kv_dir), "--kv-offload-disk", "1GiB")
    s = launch(str(default_model_dir), *ARGS, *tier)
    try:
        first = greedy(s, prompt)
        assert wait_for_files(kv_dir, 1000 // BLOCK) >= 1000 // BLOCK, "the prefix's blocks were not written"
    finally:
        s.stop()

    s = launch(str(default_model_dir), *ARGS, *tier)
    try:
        computed_before = s.metric("pagemill_prefill_tokens_total")
        second = greedy(s, prompt)
        loaded = s.metric("pagemill_kv_tier_loaded_blocks_total") * BLOCK
        computed = s.metric("pagemill_prefill_tokens_total") - computed_before
        failed = s.metric("pagemill_kv_tier_failed_loads_total")
        load_s = s.metric("pagemill_kv_tier_load_seconds_total")
        stored = s.metric("pagemill_kv_tier_blocks")
        print("\n".join(line for line in s.log if "KV tier" in line or "second KV tier" in line))
        saved_s = s.metric("pagemill_kv_tier_recompute_saved_seconds_total")
    finally:
        s.stop()
    print(f"loaded {loaded:.0f} prompt tokens, computed {computed:.0f}; load {load_s * 1e3:.1f} ms vs "
          f"~{saved_s * 1e3:.0f} ms of prefill saved")
    assert stored >= 1000 // BLOCK, "the restarted server did not index the files"
    assert loaded >= 0.9 * 1000, f"only {loaded} of the 1,000 prefix tokens were loaded"
    assert failed == 0
    assert computed < 100, f"{computed} prompt tokens computed after the restart"
    assert second == first, "the loaded prefix changed the greedy output"
