"""Two shard groups reached over TCP on 127.0.0.1 with the shared token on
(`pagemill shard --listen`, `pagemill router --shard-group host:port`): the
router serves through both, and a call without the token, or with another
one, is refused with UNAUTHENTICATED."""

import os
import signal
import subprocess
import sys
import time

import grpc
import httpx
import pytest

from server import free_port


def _shard(model_dir, port: int, token_file) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "pagemill", "shard", "--model-dir", str(model_dir),
                             "--listen", f"127.0.0.1:{port}", "--shard-auth-token-file", str(token_file),
                             "--kv-cache-memory", "64MiB", "--num-threads", "1", "--dtype", "float32"],
                            env=dict(os.environ, MASTER_PORT=str(free_port())))  # fmt: skip


def _router(model_dir, http_port: int, shard_ports: list[int], token_file, log) -> subprocess.Popen:
    argv = [sys.executable, "-m", "pagemill", "router", "--tokenizer-dir", str(model_dir), "--port", str(http_port),
            "--max-input-tokens", "128", "--max-total-tokens", "256", "--shard-auth-token-file", str(token_file)]
    for p in shard_ports:
        argv += ["--shard-group", f"127.0.0.1:{p}"]
    return subprocess.Popen(argv, stdout=open(log, "wb"), stderr=subprocess.STDOUT)


def _health_call(port: int, metadata=None) -> grpc.StatusCode:
    from pagemill.proto import generate_pb2 as pb

    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        health = ch.unary_unary("/pagemill.v1.TextGenerationService/Health",
                                request_serializer=pb.HealthRequest.SerializeToString,
                                response_deserializer=pb.HealthResponse.FromString)
        try:
            health(pb.HealthRequest(), timeout=10, metadata=metadata)
            return grpc.StatusCode.OK
        except grpc.RpcError as e:
            return e.code()


def _wait_listening(port: int, procs, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while _health_call(port) == grpc.StatusCode.UNAVAILABLE:
        assert all(p.poll() is None for p in procs), [p.returncode for p in procs]
        assert time.monotonic() < deadline, f"shard on {port} never listened"
        time.sleep(0.5)


@pytest.mark.timeout(110)
def test_two_groups_over_tcp_with_the_token(tiny_model_dir, tmp_path):
    token_file = tmp_path / "shard.token"
    token_file.write_text("correct-horse-battery-staple\n")
    wrong_file = tmp_path / "wrong.token"
    wrong_file.write_text("not-the-token\n")
    ports, http_port = [free_port(), free_port()], free_port()
    procs = [_shard(tiny_model_dir, p, token_file) for p in ports]
    try:
        for p in ports:
            _wait_listening(p, procs)
        # Without the credential, or with another one: refused before reaching the model.
        for p in ports:
            assert _health_call(p) == grpc.StatusCode.UNAUTHENTICATED
            assert _health_call(p, [("authorization", "Bearer not-the-token")]) == grpc.StatusCode.UNAUTHENTICATED
            assert _health_call(p, [("authorization", "Bearer correct-horse-battery-staple")]) == grpc.StatusCode.OK
        # A router with the wrong token gives up at once, naming the refusal.
        bad = _router(tiny_model_dir, free_port(), ports, wrong_file, tmp_path / "bad.log")
        bad.wait(60)
        out = (tmp_path / "bad.log").read_text()
        assert bad.returncode != 0 and "refused the router" in out, out[-2000:]
        router = _router(tiny_model_dir, http_port, ports, token_file, tmp_path / "router.log")
        procs.append(router)
        url = f"http://127.0.0.1:{http_port}"
        deadline = time.monotonic() + 120
        while True:
            assert router.poll() is None, (tmp_path / "router.log").read_text()[-3000:]
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "router not healthy"
            time.sleep(0.5)
        info = httpx.get(f"{url}/info", timeout=10).json()
        assert info["data_parallel"] == 2
        texts = []
        for i in range(4):
            r = httpx.post(f"{url}/generate", timeout=60,
                           json={"inputs": f"prompt number {i}", "parameters": {"max_new_tokens": 5}})
            assert r.status_code == 200, r.text
            texts.append(r.json()["generated_text"])
        placed = [g["requests_placed_total"] for g in httpx.get(f"{url}/info", timeout=10).json()["groups"]]
        assert placed[0] > 0 and placed[1] > 0, placed
        for p in reversed(procs):  # router first, then the shards: all exit cleanly
            p.send_signal(signal.SIGTERM)
            assert p.wait(60) == 0
    finally:
        for p in reversed(procs):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in reversed(procs):
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
