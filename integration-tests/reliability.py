"""Helpers of the reliability tests (soak, faults, drain, hostile input):
one request of each API flavour, checked complete and correct."""

from __future__ import annotations

import contextlib
import json
import subprocess
import time

import httpx
import psutil

# Every flavour the soak mixes; `check` raises AssertionError on a wrong answer.
FLAVOURS = ("generate", "generate_stream", "completions", "completions_stream", "chat", "chat_stream")


@contextlib.contextmanager
def stopped_after(server):
    """Stops `server` when the block ends, even when a test fails midway
    (tests that stop it themselves leave nothing to do)."""
    try:
        yield server
    except BaseException:
        # Shown with the failure (pytest prints what the test wrote): a hang or a timeout
        # is otherwise diagnosed without the server's side of it.
        print(f"--- the server's last {len(server.log)} log lines ---\n{server.logs()}")
        raise
    finally:
        if server.proc.poll() is None:
            try:
                server.stop(timeout=60)
            except subprocess.TimeoutExpired:
                server.proc.kill()


def router_process(server) -> psutil.Process:
    """The launcher runs the router as its own child (`python -m pagemill router`)."""
    for kid in psutil.Process(server.proc.pid).children(recursive=True):
        argv = kid.cmdline()
        if "router" in argv and "pagemill" in " ".join(argv):
            return kid
    raise LookupError("no router process under the launcher")


def wait_idle(server, timeout: float = 20) -> dict:
    """Polls /info until nothing runs or waits and every KV block is free again."""
    deadline = time.monotonic() + timeout
    info = server.info()
    while time.monotonic() < deadline:
        info = server.info()
        if info["batch_size"] == 0 and info["queue_size"] == 0 and info["kv_blocks_used"] == 0:
            return info
        time.sleep(0.2)
    raise AssertionError(f"not idle after {timeout}s: {info}")


def _sse_data(lines) -> list[str]:
    return [line[5:].strip() for line in lines if line.startswith("data:")]


def request(flavour: str, i: int, n_tokens: int) -> tuple[str, dict]:
    """(path, body) of request `i` of `flavour`, generating exactly `n_tokens`
    on TGI routes (ignore_eos) and at most `n_tokens` on OpenAI routes."""
    prompt = f"Request {i}: the quick brown fox number {i * 7919 % 1000} jumps over"
    if flavour in ("generate", "generate_stream"):
        return "/" + flavour, {"inputs": prompt, "parameters": {
            "max_new_tokens": n_tokens, "ignore_eos_token": True, "details": True,
            **({"do_sample": True, "seed": i, "top_k": 50} if i % 2 else {})}}
    if flavour.startswith("completions"):
        return "/v1/completions", {"prompt": prompt, "max_tokens": n_tokens, "seed": i,
                                   "stream": flavour.endswith("stream"),
                                   **({"stream_options": {"include_usage": True}} if flavour.endswith("stream") else {})}
    return "/v1/chat/completions", {"messages": [{"role": "system", "content": "Be brief."},
                                                 {"role": "user", "content": prompt}],
                                    "max_tokens": n_tokens, "seed": i, "stream": flavour.endswith("stream"),
                                    **({"stream_options": {"include_usage": True}} if flavour.endswith("stream") else {})}


def check(flavour: str, n_tokens: int, status: int, body: bytes) -> None:
    """The whole answer of one request: status, token counts, finish reason, stream framing."""
    text = body.decode()
    assert status == 200, f"{flavour}: {status} {text[:300]}"
    if flavour == "generate":
        d = json.loads(text)["details"]
        assert d["finish_reason"] == "length" and d["generated_tokens"] == n_tokens, d
        assert len(d["tokens"]) == n_tokens
        return
    if flavour == "generate_stream":
        events = [json.loads(x) for x in _sse_data(text.splitlines())]
        assert len(events) == n_tokens, f"{len(events)} events for {n_tokens} tokens"
        assert [e["index"] for e in events] == list(range(1, n_tokens + 1))
        assert all("error" not in e for e in events), events[-1]
        assert all(e["generated_text"] is None for e in events[:-1])
        last = events[-1]
        assert last["generated_text"] is not None
        assert last["details"]["generated_tokens"] == n_tokens and last["details"]["finish_reason"] == "length"
        return
    streaming = flavour.endswith("stream")
    if not streaming:
        r = json.loads(text)
        (choice,) = r["choices"]
        used = r["usage"]["completion_tokens"]
        _check_finish(choice["finish_reason"], used, n_tokens)
        content = choice["text"] if flavour == "completions" else choice["message"]["content"]
        assert isinstance(content, str)
        return
    data = _sse_data(text.splitlines())
    assert data and data[-1] == "[DONE]", f"{flavour}: stream did not end with [DONE]: {data[-2:]}"
    chunks = [json.loads(x) for x in data[:-1]]
    assert all("error" not in c for c in chunks), chunks[-1]
    usage = chunks[-1]
    assert usage["choices"] == [] and usage["usage"], usage
    token_chunks = chunks[:-1]
    finishes = [c["choices"][0]["finish_reason"] for c in token_chunks]
    assert all(f is None for f in finishes[:-1]) and finishes[-1] is not None, finishes
    used = usage["usage"]["completion_tokens"]
    # One chunk per generated token.
    assert len(token_chunks) == used, (len(token_chunks), used)
    _check_finish(finishes[-1], used, n_tokens)


def _check_finish(reason: str, used: int, n_tokens: int) -> None:
    # A random model may sample EOS early ("stop"), never run past max_tokens.
    if reason == "length":
        assert used == n_tokens, (reason, used, n_tokens)
    else:
        assert reason == "stop" and 1 <= used <= n_tokens, (reason, used, n_tokens)


def post(client: httpx.Client, url: str, flavour: str, i: int, n_tokens: int) -> tuple[int, bytes]:
    path, body = request(flavour, i, n_tokens)
    r = client.post(url + path, json=body)
    return r.status_code, r.content
