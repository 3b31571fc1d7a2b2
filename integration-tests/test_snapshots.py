"""Full JSON responses of greedy requests against stored snapshots
(integration-tests/snapshots/*.json): token ids, texts and finish reasons
exactly, logprobs within 1e-3. Regenerate with `--snapshot-update` or
PAGEMILL_SNAPSHOT_UPDATE=1 after an intended change."""

import json
from pathlib import Path

import httpx
import pytest

SNAPSHOTS = Path(__file__).parent / "snapshots"
TOLERANCE = 1e-3
# Differ on every call by design.
VOLATILE = {"id", "created", "system_fingerprint", "model"}

CHAT = [{"role": "user", "content": "What is the capital of France?"}]
CASES = {
    "generate_details": ("/generate", {"inputs": "The three primary colors are", "parameters": {
        "max_new_tokens": 12, "details": True, "decoder_input_details": True, "top_n_tokens": 2}}),
    "generate_stop": ("/generate", {"inputs": "Count: 1, 2, 3, 4,", "parameters": {
        "max_new_tokens": 20, "details": True, "stop": [" 7"]}}),
    "generate_chatml": ("/generate", {"inputs": "<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n",
                                      "parameters": {"max_new_tokens": 40, "details": True}}),
    "chat": ("/v1/chat/completions", {"messages": CHAT, "temperature": 0, "max_tokens": 16, "logprobs": True,
                                      "top_logprobs": 2}),
    "completions": ("/v1/completions", {"prompt": ["def fibonacci(n):", "The sky is"], "temperature": 0,
                                        "max_tokens": 10, "logprobs": 1}),
}


def scrub(v):
    if isinstance(v, dict):
        return {k: scrub(x) for k, x in v.items() if k not in VOLATILE}
    if isinstance(v, list):
        return [scrub(x) for x in v]
    return v


def compare(got, want, path="$"):
    """Exact except floats (logprobs), which may move by TOLERANCE."""
    if isinstance(want, dict):
        assert isinstance(got, dict) and set(got) == set(want), f"{path}: keys {sorted(got)} != {sorted(want)}"
        for k in want:
            compare(got[k], want[k], f"{path}.{k}")
    elif isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want), f"{path}: length {len(got)} != {len(want)}"
        for i, (g, w) in enumerate(zip(got, want)):
            compare(g, w, f"{path}[{i}]")
    elif isinstance(want, float) and not isinstance(want, bool):
        assert isinstance(got, (int, float)) and abs(got - want) <= TOLERANCE, f"{path}: {got} != {want}"
    else:
        assert got == want, f"{path}: {got!r} != {want!r}"


@pytest.mark.parametrize("name", sorted(CASES))
def test_snapshot(server, snapshot_update, name):
    route, body = CASES[name]
    r = httpx.post(server.url + route, json=body, timeout=120)
    assert r.status_code == 200, r.text
    got = scrub(r.json())
    path = SNAPSHOTS / f"{name}.json"
    if snapshot_update or not path.exists():
        if not snapshot_update:
            pytest.fail(f"no snapshot {path.name}: run with --snapshot-update to create it")
        SNAPSHOTS.mkdir(exist_ok=True)
        path.write_text(json.dumps({"request": {"route": route, "body": body}, "response": got}, indent=1,
                                   ensure_ascii=False) + "\n")
        return
    want = json.loads(path.read_text())
    assert want["request"] == {"route": route, "body": body}, "the case changed: update its snapshot"
    compare(got, want["response"])


def test_compare_tolerates_only_small_float_drift():
    compare({"a": [1, 2.0005]}, {"a": [1, 2.0]})
    with pytest.raises(AssertionError):
        compare({"a": [1, 2.01]}, {"a": [1, 2.0]})
    with pytest.raises(AssertionError):
        compare({"id": 5}, {"id": 6})
