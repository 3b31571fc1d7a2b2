"""`--batch-invariant` end to end: 16 greedy and 16 seeded requests give the same tokens and
logprobs alone as inside a 64-request crowd, in bfloat16, on a server of two data-parallel
groups placing requests round-robin (so a request's answer alone and in the crowd often comes
from different groups)."""

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from server import launch

NEW = 10


def _prompt(i: int) -> str:
    return f"Request {i}: " + " ".join(f"word{(i * 7 + k) % 50}" for k in range(5 + i % 23))


def _params(i: int) -> dict:
    p = {"max_new_tokens": NEW, "ignore_eos_token": True, "details": True}
    if i % 2:  # seeded sampling
        p |= {"do_sample": True, "temperature": 0.8, "top_p": 0.95, "seed": 100 + i}
    return p


def _generate(url: str, i: int) -> tuple[str, list[float]]:
    r = httpx.post(f"{url}/generate", timeout=300, json={"inputs": _prompt(i), "parameters": _params(i)})
    assert r.status_code == 200, r.text
    body = r.json()
    return body["generated_text"], [t["logprob"] for t in body["details"]["tokens"]]


done: list[bool] = []


def _max_running(server) -> float:
    """The most sequences seen in the running batch while the crowd is in flight."""
    most = 0.0
    while not done:
        most = max(most, server.metric("pagemill_batch_size"))
    return most


@pytest.mark.timeout(400)
def test_alone_equals_inside_a_crowd_across_groups(tiny_model_dir):
    s = launch(str(tiny_model_dir), "--batch-invariant", "--dtype", "bfloat16", "--data-parallel", "2",
               "--routing", "round-robin", "--max-input-tokens", "128", "--max-total-tokens", "256",
               "--max-batch-prefill-tokens", "256")  # fmt: skip
    try:
        targets = list(range(32))  # 16 greedy (even), 16 seeded (odd)
        alone = {i: _generate(s.url, i) for i in targets}
        with ThreadPoolExecutor(65) as pool:
            running = pool.submit(_max_running, s)
            crowd = dict(zip(range(64), pool.map(lambda i: _generate(s.url, i), range(64))))
            done.append(True)
            assert running.result() > 1, "the crowd never shared a step"
        for i in targets:
            kind = "seeded" if i % 2 else "greedy"
            assert crowd[i][0] == alone[i][0], f"{kind} request {i}: text differs inside the crowd"
            assert crowd[i][1] == alone[i][1], f"{kind} request {i}: logprobs differ inside the crowd"
    finally:
        s.stop()
