"""The real shard process (serve(ShardConfig)) driven over its unix socket.

The BlockRouter harness (bench/block_router.py) plays the router: shuffled block
ids, a new block when a sequence crosses a block boundary, one Step per
iteration. In-process Step semantics (chunks, mixed steps, preemption):
test_step.py.
"""

from __future__ import annotations

import json
import math
import os
import signal
import socket
import subprocess
import sys
import time

import grpc
import pytest
import torch

from conftest import ROOT, build_model_dir, load_hf
from pagemill.proto import SERVICE_NAME, pb
from pagemill.bench.block_router import BlockRouter
from pagemill.shard.main import _remove_stale_socket

BLOCK_SIZE = 4
NUM_LAYERS, KV_HEADS, HEAD_DIM = 2, 2, 16  # llama_gqa
BLOCK_BYTES = 2 * NUM_LAYERS * KV_HEADS * HEAD_DIM * BLOCK_SIZE * 4
POOL_BLOCKS = 200
EOS_PROMPT = [5, 17, 99, 42, 7, 250]

RPCS = {
    "Info": pb.InfoResponse,
    "Health": pb.HealthResponse,
    "Warmup": pb.WarmupResponse,
    "Step": pb.StepResponse,
}


class Client:
    def __init__(self, uds_path: str) -> None:
        self.channel = grpc.insecure_channel(f"unix://{uds_path}")
        self.stubs = {
            name: self.channel.unary_unary(
                f"/{SERVICE_NAME}/{name}", request_serializer=lambda m: m.SerializeToString(),
                response_deserializer=resp.FromString,
            )  # fmt: skip
            for name, resp in RPCS.items()
        }

    def __getattr__(self, name):
        stub = self.stubs[name]
        return lambda request: stub(request, timeout=60)


INVALID = grpc.StatusCode.INVALID_ARGUMENT


def status_of(call) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as e:
        call()
    return e.value.code()


@torch.no_grad()
def hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    """Plain greedy argmax with transformers, never stopping at EOS (ignore_eos)."""
    tokens = list(prompt)
    for _ in range(n):
        tokens.append(int(hf(torch.tensor([tokens])).logits[0, -1].argmax()))
    return tokens[len(prompt) :]


@pytest.fixture(scope="module")
def shard(tmp_path_factory):
    """Starts the shard process; yields (client, hf model, eos id, pre-warmup status, warmup response)."""
    model_dir = build_model_dir(str(tmp_path_factory.mktemp("svc_model")), "llama_gqa")
    hf = load_hf(model_dir)
    # Make EOS the 4th greedy token of EOS_PROMPT (its first occurrence), so a
    # request finishes on EOS deterministically.
    cont = hf_greedy(hf, EOS_PROMPT, 10)
    eos_at = next(i for i in range(3, 10) if cont[i] not in cont[:i] and cont[i] not in EOS_PROMPT)
    eos = cont[eos_at]
    for name in ("config.json", "generation_config.json"):
        path = os.path.join(model_dir, name)
        with open(path) as f:
            data = json.load(f)
        data["eos_token_id"] = eos
        with open(path, "w") as f:
            json.dump(data, f)
    hf.generation_config.eos_token_id = eos

    sock = str(tmp_path_factory.mktemp("sock") / "shard.sock")
    stale = socket.socket(socket.AF_UNIX)  # a socket left by a killed shard must be replaced
    stale.bind(sock)
    stale.close()
    code = (
        "from pagemill.config import ShardConfig; from pagemill.shard.main import serve; "
        f"serve(ShardConfig(model_dir={model_dir!r}, uds_path={sock!r}, block_size={BLOCK_SIZE}, "
        f"kv_cache_memory={POOL_BLOCKS * BLOCK_BYTES}, num_threads=1, dtype='float32'))"  # exact vs HF float32
    )
    log_path = tmp_path_factory.mktemp("log") / "shard.log"
    log = open(log_path, "w")
    env = {**os.environ, "PYTHONPATH": os.path.join(ROOT, "server")}
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=log, stderr=subprocess.STDOUT, env=env)
    client = Client(sock)
    deadline = time.time() + 120
    while True:
        try:
            client.Info(pb.InfoRequest())
            break
        except grpc.RpcError:
            if proc.poll() is not None or time.time() > deadline:
                proc.kill()
                raise RuntimeError(f"shard did not start:\n{open(log_path).read()}")
            time.sleep(0.2)
    pre = status_of(lambda: client.Step(pb.StepRequest()))
    warm = client.Warmup(pb.WarmupRequest(max_batch_prefill_tokens=64, max_input_tokens=32, max_total_tokens=64,
                                          max_batch_size=8))  # fmt: skip
    yield client, hf, eos, pre, warm
    client.channel.close()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0, open(log_path).read()
    assert not os.path.exists(sock), "socket left behind"
    assert "ready on unix://" in open(log_path).read()


@pytest.fixture
def router(shard):
    client = shard[0]
    r = BlockRouter(client.Step, shard[4].num_blocks, BLOCK_SIZE)
    yield r
    for rid in list(r.requests):  # what a test left running: the shard hears it and drops it
        r.abort(rid)
    r.step([])


def test_info_health_warmup(shard):
    client, hf, eos, pre, warm = shard
    info = client.Info(pb.InfoRequest())
    assert (info.dtype, info.device_type, info.block_size, info.vocab_size) == ("float32", "cpu", BLOCK_SIZE, 320)
    assert list(info.eos_token_ids) == [eos] and info.attention_backend == "torch" and info.world_size == 1
    assert info.sliding_window == 0  # no layer slides: the router frees nothing behind a window
    client.Health(pb.HealthRequest())
    assert pre == grpc.StatusCode.FAILED_PRECONDITION  # Step before Warmup
    assert warm.num_blocks == POOL_BLOCKS and warm.block_size == BLOCK_SIZE and warm.warmup_ns > 0
    too_long = pb.WarmupRequest(
        max_batch_prefill_tokens=8, max_input_tokens=8, max_total_tokens=10**6, max_batch_size=1
    )
    assert status_of(lambda: client.Warmup(too_long)) == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert client.Warmup(pb.WarmupRequest(max_batch_prefill_tokens=64, max_input_tokens=32, max_total_tokens=64,
                                          max_batch_size=8)).num_blocks == POOL_BLOCKS  # fmt: skip


def test_warmup_drops_every_request(shard):
    client, *_ = shard
    router = BlockRouter(client.Step, POOL_BLOCKS, BLOCK_SIZE)
    router.add(1, [5, 6, 7], 5)
    router.step()
    client.Warmup(pb.WarmupRequest(max_batch_prefill_tokens=64, max_input_tokens=32, max_total_tokens=64,
                                   max_batch_size=8))  # fmt: skip
    (gen,) = router.step().generations
    assert "unknown" in gen.error and not gen.tokens.ids


def test_greedy_generation_matches_transformers(shard, router):
    client, hf, eos, *_ = shard
    g = torch.Generator().manual_seed(11)
    lengths = {10: 6, 11: 13, 12: 3, 13: 9}
    prompts = {rid: torch.randint(3, 320, (n,), generator=g).tolist() for rid, n in lengths.items()}
    max_new = {10: 12, 11: 7, 12: 15, 13: 9}
    for rid in (10, 11, 12):
        router.add(rid, prompts[rid], max_new[rid], ignore_eos=True, top_n=3 if rid == 11 else 0)
    resp = router.step()
    assert [g.request_id for g in resp.generations] == [10, 11, 12]
    assert resp.forward_ns > 0 and resp.total_ns >= resp.forward_ns
    for step in range(1, 100):
        if step == 2:  # a request joins mid-way: its prompt rides in the others' decode step
            router.add(13, prompts[13], max_new[13], ignore_eos=True)
        if not router.requests:
            break
        resp = router.step()
        for gen in resp.generations:
            o = router.outputs[gen.request_id]
            if gen.finish_reason:
                assert gen.finish_reason == pb.FINISH_REASON_LENGTH and len(o.ids) == max_new[gen.request_id]
    for rid, prompt in prompts.items():
        expected = hf_greedy(hf, prompt, max_new[rid])
        out = router.outputs[rid]
        assert out.ids == expected, f"request {rid}"
        with torch.no_grad():
            logp = hf(torch.tensor([prompt + expected])).logits[0].log_softmax(-1)
        ref = [logp[len(prompt) - 1 + i, t].item() for i, t in enumerate(expected)]
        assert out.logprobs == pytest.approx(ref, abs=1e-4)
    out11 = router.outputs[11]
    assert all(len(t) == 3 and t[0] == i for t, i in zip(out11.top, out11.ids))
    # Finished requests are gone from the shard: naming one again fails that entry alone.
    stale = pb.ScheduledRequest(id=10, num_computed=18, num_tokens=1)
    (gen,) = client.Step(pb.StepRequest(requests=[stale])).generations
    assert gen.request_id == 10 and "unknown" in gen.error


def test_a_step_sent_before_the_last_reply_runs_after_it(shard, router):
    """The router may send step N+1 before step N's reply (router/src/scheduler/ahead.rs): each
    decode names the token step N samples, which only the shard knows yet, and N+1 names N as its
    after_step_id. The two calls may reach the service in either order: here N+1 always comes
    first. The shard must run N first, and the tokens must be transformers' as with one step at
    a time."""
    client, hf, *_ = shard
    call = client.stubs["Step"]
    g = torch.Generator().manual_seed(5)
    prompts = {30: torch.randint(3, 320, (7,), generator=g).tolist(), 31: torch.randint(3, 320, (4,), generator=g).tolist()}
    max_new = 11
    for rid, prompt in prompts.items():
        router.add(rid, prompt, max_new, ignore_eos=True)
    router.step()  # the prompts and their first tokens
    sent, step_id, ahead = client.Step, 1000, 0
    try:
        while router.requests:
            a = router.plan()
            step_id += 2
            a.step_id = step_id
            b = pb.StepRequest(step_id=step_id + 1, after_step_id=step_id)
            for e in a.requests:
                t = router.requests[e.id]
                if len(router.outputs[e.id].ids) + 1 >= max_new:
                    continue  # a's token is its last
                have = t.sent_blocks + len(e.new_block_ids)
                router.blocks.grow(t.table, e.num_computed + 2)
                b.requests.add(id=e.id, num_computed=e.num_computed + 1, num_tokens=1, new_block_ids=t.table[have:])
            pending_b = call.future(b, timeout=60) if b.requests else None
            if pending_b is not None:
                time.sleep(0.05)  # b reaches the shard first and must wait for a
                assert not pending_b.done()
                ahead += 1
            pending_a = call.future(a, timeout=60)
            router._step = lambda _req: pending_a.result()
            router.send(a)
            if pending_b is not None:
                router._step = lambda _req: pending_b.result()
                resp = router.send(b)
                assert all(not gen.error and len(gen.tokens.ids) == 1 for gen in resp.generations)
    finally:
        router._step = sent
    assert ahead >= 4
    for rid, prompt in prompts.items():
        assert router.outputs[rid].ids == hf_greedy(hf, prompt, max_new), f"request {rid}"


def test_eos_finishes_and_matches_generate(shard, router):
    client, hf, eos, *_ = shard
    router.add(20, EOS_PROMPT, 10)
    router.add(21, EOS_PROMPT, 10, ignore_eos=True)
    out = router.run()
    with torch.no_grad():
        generated = hf.generate(torch.tensor([EOS_PROMPT]), max_new_tokens=10, do_sample=False, pad_token_id=0)
    expected = generated[0, len(EOS_PROMPT) :].tolist()
    assert expected[-1] == eos and len(expected) < 10
    assert out[20].ids == expected and out[20].finish == pb.FINISH_REASON_EOS_TOKEN
    assert out[21].ids == hf_greedy(hf, EOS_PROMPT, 10) and out[21].finish == pb.FINISH_REASON_LENGTH
    assert eos in out[21].ids


def test_finish_at_first_step_and_prompt_logprobs(shard, router):
    client, hf, *_ = shard
    prompt = [3, 14, 15, 92, 65, 35]
    out = router.add(30, prompt, 1, prefill_logprobs=True)
    (gen,) = router.step().generations
    assert gen.finish_reason == pb.FINISH_REASON_LENGTH and gen.prompt_logprobs.first == 1
    assert not router.requests
    lps = out.prompt
    with torch.no_grad():
        logp = hf(torch.tensor([prompt])).logits[0].log_softmax(-1)
    assert math.isnan(lps[0])
    assert lps[1:] == pytest.approx([logp[i, prompt[i + 1]].item() for i in range(len(prompt) - 1)], abs=1e-4)


def test_cached_prefix_request(shard, router):
    """The router's prefix cache: request 41 reuses two full blocks request 40 computed."""
    client, hf, *_ = shard
    base = [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17]
    router.add(40, base, 5, ignore_eos=True)
    router.step()
    other = base[:8] + [200, 201, 202]
    router.add(41, other, 6, prefix=(40, 8), ignore_eos=True, prefill_logprobs=True)
    step = router.plan([41])
    assert step.requests[0].num_computed == 8 and len(step.requests[0].new_block_ids) == 3
    router.send(step)
    out = router.run()
    assert out[41].ids == hf_greedy(hf, other, 6)
    lps = out[41].prompt  # NaN where the predecessor was cached: the router fills those
    assert all(math.isnan(x) for x in lps[:9]) and not any(math.isnan(x) for x in lps[9:])


def test_forks_share_prompt_blocks_computed_in_the_same_step(shard, router):
    """n/best_of: forks count as computed the prompt blocks the first fork computes in this very step."""
    client, hf, *_ = shard
    prompt = [33, 34, 35, 36, 37, 38, 39, 40, 41]
    router.add(90, prompt, 5, ignore_eos=True)
    router.add(91, prompt, 5, ignore_eos=True, prefix=(90, 8))
    router.add(92, prompt, 5, ignore_eos=True, prefix=(90, 4))
    first = router.plan()
    assert [e.num_computed for e in first.requests] == [0, 8, 4]
    assert first.requests[1].new_block_ids[:2] == first.requests[0].new_block_ids[:2]
    router.send(first)
    out = router.run()
    expected = hf_greedy(hf, prompt, 5)
    assert out[90].ids == out[91].ids == out[92].ids == expected


def test_bad_input_gets_a_status_not_a_crash(shard, router):
    client, hf, *_ = shard
    prompt = [21, 22, 23, 24, 25]
    router.add(60, prompt, 8, ignore_eos=True)
    router.add(62, prompt, 8, ignore_eos=True)
    router.step()
    router.add(61, [1, 2, 3, 4, 5, 6], 4)

    def status(mutate) -> grpc.StatusCode:
        req = router.plan([60, 61])
        req.finished_ids.append(62)  # a rejected step drops nothing either
        mutate(req)
        return status_of(lambda: router.send(req))

    def entry(rid):
        return lambda req: next(e for e in req.requests if e.id == rid)

    old, new = entry(60), entry(61)
    assert status(lambda r: old(r).new_block_ids.append(0)) == INVALID  # scratch block
    assert status(lambda r: old(r).new_block_ids.append(POOL_BLOCKS)) == INVALID  # no such block
    assert status(lambda r: new(r).new_block_ids.append(new(r).new_block_ids[0])) == INVALID  # repeated block
    assert status(lambda r: old(r).new_block_ids.append(router.requests[60].table[0])) == INVALID  # already held
    assert status(lambda r: new(r).new_block_ids.pop()) == INVALID  # table too short
    assert status(lambda r: setattr(new(r), "num_tokens", 0)) == INVALID
    assert status(lambda r: setattr(old(r), "num_tokens", 2)) == INVALID  # past the known tokens
    assert status(lambda r: r.requests.append(r.requests[0])) == INVALID  # an id twice
    assert status(lambda r: new(r).new_request.input_ids.append(1000)) == INVALID  # > vocab
    assert status(lambda r: new(r).new_request.ClearField("input_ids")) == INVALID
    assert status(lambda r: setattr(new(r), "num_computed", 6)) == INVALID  # nothing left to compute
    assert status(lambda r: setattr(new(r).new_request.parameters, "temperature", -1.0)) == INVALID
    assert status(lambda r: setattr(new(r).new_request.stopping_parameters, "max_new_tokens", 0)) == INVALID
    assert status(lambda r: setattr(new(r).new_request, "generated_len", 6)) == INVALID

    # Nothing above changed the shard: 60 still decodes to the reference tokens, 61 starts.
    client.Health(pb.HealthRequest())
    gens = router.step().generations
    assert [g.request_id for g in gens] == [60, 62, 61] and not any(g.error for g in gens)
    assert router.outputs[60].ids == router.outputs[62].ids == hf_greedy(hf, prompt, 2)


def test_seeded_sampling_is_reproducible(shard, router):
    client, *_ = shard
    params = pb.NextTokenChooserParameters(do_sample=True, temperature=1.0, top_p=0.95, seed=42, has_seed=True)

    def run(rid: int, companions: int) -> list[int]:
        router.add(rid, [5, 6, 7], 6, ignore_eos=True, params=params)
        unseeded = pb.NextTokenChooserParameters(do_sample=True)
        for i in range(companions):
            router.add(rid + 1 + i, [8, 9], 6, ignore_eos=True, params=unseeded)
        return router.run()[rid].ids

    assert run(80, 0) == run(90, 3)


def test_stale_regular_file_is_not_replaced(tmp_path):
    path = tmp_path / "not-a-socket"
    path.write_text("precious")
    with pytest.raises(FileExistsError, match="not a socket"):
        _remove_stale_socket(str(path))
    assert path.read_text() == "precious"


def test_health_fails_once_a_forward_broke(tmp_path):
    from pagemill.config import ShardConfig
    from pagemill.shard.model_runner import ModelRunner
    from pagemill.shard.errors import ShardError

    model_dir = build_model_dir(str(tmp_path), "llama_gqa")
    runner = ModelRunner.from_shard_config(
        ShardConfig(model_dir=model_dir, uds_path="unused", block_size=BLOCK_SIZE, kv_cache_memory=64 * BLOCK_BYTES,
                    dtype="float32")
    )
    runner.health()
    runner.warmup(
        pb.WarmupRequest(max_batch_prefill_tokens=16, max_input_tokens=8, max_total_tokens=32, max_batch_size=2)
    )
    router = BlockRouter.for_runner(runner)
    router.add(1, [1, 2, 3], 4)
    runner.model.model.embed_tokens = None  # sabotage: the forward now raises
    with pytest.raises(TypeError):
        router.step()
    with pytest.raises(ShardError) as e:
        runner.health()
    assert e.value.code == grpc.StatusCode.UNAVAILABLE and "TypeError" in e.value.message


class _SlowRunner:
    """A runner whose Step blocks until released: a long prefill, as far as the service can tell."""

    def __init__(self) -> None:
        import threading

        self.started, self.release = threading.Event(), threading.Event()
        self.broken: str | None = None
        self.store = None

    def info(self):
        return pb.InfoResponse(model_id="slow", dtype="float32", device_type="cpu", attention_backend="torch")

    def check_not_broken(self) -> None:
        from pagemill.shard.errors import ShardError

        if self.broken is not None:
            raise ShardError(grpc.StatusCode.UNAVAILABLE, f"shard is broken: {self.broken}")

    def health(self) -> None:
        self.check_not_broken()

    def step(self, request):
        from types import SimpleNamespace

        self.started.set()
        assert self.release.wait(30)
        return SimpleNamespace(generations=[], forward_ns=0, tier=None)


def test_health_answers_while_a_long_step_runs(tmp_path):
    """The router's step watch (recover.rs) probes Health beside a step that runs for seconds and
    takes 12 s without an answer for a hung shard: the shard must answer while the step runs, and
    still report a forward that broke."""
    import asyncio
    import threading

    from pagemill.shard.main import serve_runner
    from pagemill.shard.service import new_model_thread

    runner, sock = _SlowRunner(), str(tmp_path / "slow.sock")
    loop = asyncio.new_event_loop()
    stop = asyncio.Event()
    server = threading.Thread(target=loop.run_until_complete,
                              args=(serve_runner(runner, sock, stop, model_thread=new_model_thread()),))  # fmt: skip
    server.start()
    client = Client(sock)
    try:
        deadline = time.time() + 30
        while not os.path.exists(sock) and time.time() < deadline:
            time.sleep(0.05)
        step = threading.Thread(target=lambda: client.Step(pb.StepRequest()))
        step.start()
        assert runner.started.wait(30)
        t = time.perf_counter()
        client.stubs["Health"](pb.HealthRequest(), timeout=5)
        assert time.perf_counter() - t < 2 and not runner.release.is_set()  # answered during the step
        runner.broken = "RuntimeError: the forward failed"
        assert status_of(lambda: client.stubs["Health"](pb.HealthRequest(), timeout=5)) == grpc.StatusCode.UNAVAILABLE
        runner.release.set()
        step.join(30)
    finally:
        runner.release.set()
        client.channel.close()
        loop.call_soon_threadsafe(stop.set)
        server.join(30)
