"""The real shard process (serve(ShardConfig)) driven over its unix socket.

The test plays the router: it hands out (shuffled) block ids, adds a block
when a sequence crosses a block boundary, and sends every step's slots.
"""

from __future__ import annotations

import json
import math
import os
import random
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
    "Prefill": pb.PrefillResponse,
    "Decode": pb.DecodeResponse,
    "FilterBatch": pb.FilterBatchResponse,
    "ClearCache": pb.ClearCacheResponse,
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


NOT_FOUND, INVALID = grpc.StatusCode.NOT_FOUND, grpc.StatusCode.INVALID_ARGUMENT


def prefill(client: "Client", batch_id: int, *requests: pb.Request) -> pb.PrefillResponse:
    return client.Prefill(pb.PrefillRequest(batch=pb.Batch(id=batch_id, requests=requests)))


def status_of(call) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as e:
        call()
    return e.value.code()


class FakeRouter:
    def __init__(self, num_blocks: int, seed: int = 0) -> None:
        self.free = list(range(1, num_blocks))
        random.Random(seed).shuffle(self.free)
        self.tables: dict[int, list[int]] = {}
        self.fed: dict[int, int] = {}  # positions whose KV the shard holds after the last step

    def _grow(self, rid: int, length: int) -> None:
        table = self.tables.setdefault(rid, [])
        while len(table) * BLOCK_SIZE < length:
            table.append(self.free.pop())

    def slot(self, rid: int, pos: int) -> int:
        return self.tables[rid][pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE

    def request(self, rid, input_ids, max_new_tokens, *, cache_len=0, shared=(), ignore_eos=False, params=None,
                top_n=0, prefill_logprobs=False) -> pb.Request:  # fmt: skip
        self.tables[rid] = list(shared)
        self._grow(rid, len(input_ids))
        self.fed[rid] = len(input_ids)
        return pb.Request(
            id=rid,
            input_ids=input_ids,
            cache_len=cache_len,
            block_table=self.tables[rid],
            slots=[self.slot(rid, p) for p in range(cache_len, len(input_ids))],
            parameters=params or pb.NextTokenChooserParameters(),
            stopping_parameters=pb.StoppingCriteriaParameters(
                max_new_tokens=max_new_tokens, ignore_eos_token=ignore_eos
            ),
            top_n_tokens=top_n,
            prefill_logprobs=prefill_logprobs,
        )

    def slots(self, rids) -> list[pb.RequestSlots]:
        out = []
        for rid in rids:
            pos = self.fed[rid]
            self._grow(rid, pos + 1)  # a new block only when crossing a boundary
            out.append(pb.RequestSlots(request_id=rid, block_table=self.tables[rid], slots=[self.slot(rid, pos)]))
        return out

    def decode(self, client: Client, batches: list[pb.CachedBatch]) -> pb.DecodeResponse:
        rids = [r for b in batches for r in b.request_ids]
        resp = client.Decode(pb.DecodeRequest(batches=batches, slots=self.slots(rids)))
        for rid in rids:
            self.fed[rid] += 1
        return resp


def collect(generations, out: dict) -> None:
    for g in generations:
        entry = out.setdefault(g.request_id, {"ids": [], "logprobs": [], "top": [], "finish": 0})
        entry["ids"] += list(g.tokens.ids)
        entry["logprobs"] += list(g.tokens.logprobs)
        entry["top"] += [list(t.ids) for t in g.top_tokens]
        entry["finish"] = g.finish_reason


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
    pre = status_of(lambda: client.Prefill(pb.PrefillRequest(batch=pb.Batch(id=1, requests=[]))))
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
    client.ClearCache(pb.ClearCacheRequest())
    return FakeRouter(shard[4].num_blocks)


def test_info_health_warmup(shard):
    client, hf, eos, pre, warm = shard
    info = client.Info(pb.InfoRequest())
    assert (info.dtype, info.device_type, info.block_size, info.vocab_size) == ("float32", "cpu", BLOCK_SIZE, 320)
    assert list(info.eos_token_ids) == [eos] and info.attention_backend == "torch" and info.world_size == 1
    client.Health(pb.HealthRequest())
    assert pre == grpc.StatusCode.FAILED_PRECONDITION  # Prefill before Warmup
    assert warm.num_blocks == POOL_BLOCKS and warm.block_size == BLOCK_SIZE and warm.warmup_ns > 0
    too_long = pb.WarmupRequest(
        max_batch_prefill_tokens=8, max_input_tokens=8, max_total_tokens=10**6, max_batch_size=1
    )
    assert status_of(lambda: client.Warmup(too_long)) == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert client.Warmup(pb.WarmupRequest(max_batch_prefill_tokens=64, max_input_tokens=32, max_total_tokens=64,
                                          max_batch_size=8)).num_blocks == POOL_BLOCKS  # fmt: skip


def test_greedy_generation_matches_transformers(shard, router):
    client, hf, eos, *_ = shard
    g = torch.Generator().manual_seed(11)
    lengths = {10: 6, 11: 13, 12: 3, 13: 9}
    prompts = {rid: torch.randint(3, 320, (n,), generator=g).tolist() for rid, n in lengths.items()}
    max_new = {10: 12, 11: 7, 12: 15, 13: 9}
    reqs = [router.request(r, prompts[r], max_new[r], ignore_eos=True, top_n=3 if r == 11 else 0) for r in (10, 11, 12)]
    resp = prefill(client, 1, *reqs)
    assert list(resp.batch.request_ids) == [10, 11, 12] and resp.forward_ns > 0 and resp.total_ns >= resp.forward_ns
    out: dict = {}
    collect(resp.generations, out)
    batch, step = resp.batch, 0
    while batch.request_ids:
        if step == 2:  # a request joins mid-way: own prefill, then concatenated
            late = prefill(client, 2, router.request(13, prompts[13], max_new[13], ignore_eos=True))
            collect(late.generations, out)
            resp = router.decode(client, [batch, late.batch])
            assert resp.batch.id == 1  # keeps the first id; batch 2 is gone
            gone = pb.FilterBatchRequest(batch_id=2, request_ids=[13])
            assert status_of(lambda: client.FilterBatch(gone)) == NOT_FOUND
        else:
            resp = router.decode(client, [batch])
        collect(resp.generations, out)
        finished = {g.request_id for g in resp.generations if g.finish_reason}
        for rid in finished:
            assert out[rid]["finish"] == pb.FINISH_REASON_LENGTH and len(out[rid]["ids"]) == max_new[rid]
        batch = resp.batch if resp.HasField("batch") else pb.CachedBatch()
        assert not finished & set(batch.request_ids)  # finished requests left the batch
        step += 1
    for rid, prompt in prompts.items():
        expected = hf_greedy(hf, prompt, max_new[rid])
        assert out[rid]["ids"] == expected, f"request {rid}"
        with torch.no_grad():
            logp = hf(torch.tensor([prompt + expected])).logits[0].log_softmax(-1)
        ref = [logp[len(prompt) - 1 + i, t].item() for i, t in enumerate(expected)]
        assert out[rid]["logprobs"] == pytest.approx(ref, abs=1e-4)
    assert all(len(t) == 3 and t[0] == i for t, i in zip(out[11]["top"], out[11]["ids"]))
    assert status_of(lambda: router.decode(client, [pb.CachedBatch(id=1)])) == NOT_FOUND


def test_eos_finishes_and_matches_generate(shard, router):
    client, hf, eos, *_ = shard
    reqs = [router.request(20, EOS_PROMPT, 10), router.request(21, EOS_PROMPT, 10, ignore_eos=True)]
    resp = prefill(client, 3, *reqs)
    out: dict = {}
    collect(resp.generations, out)
    while resp.HasField("batch"):
        resp = router.decode(client, [resp.batch])
        collect(resp.generations, out)
    with torch.no_grad():
        generated = hf.generate(torch.tensor([EOS_PROMPT]), max_new_tokens=10, do_sample=False, pad_token_id=0)
    expected = generated[0, len(EOS_PROMPT) :].tolist()
    assert expected[-1] == eos and len(expected) < 10
    assert out[20]["ids"] == expected and out[20]["finish"] == pb.FINISH_REASON_EOS_TOKEN
    assert out[21]["ids"] == hf_greedy(hf, EOS_PROMPT, 10) and out[21]["finish"] == pb.FINISH_REASON_LENGTH
    assert eos in out[21]["ids"]


def test_finish_at_prefill_and_prompt_logprobs(shard, router):
    client, hf, *_ = shard
    prompt = [3, 14, 15, 92, 65, 35]
    resp = prefill(client, 4, router.request(30, prompt, 1, prefill_logprobs=True))
    assert not resp.HasField("batch")  # everything finished: nothing cached
    (gen,) = resp.generations
    assert gen.finish_reason == pb.FINISH_REASON_LENGTH and list(gen.prefill_tokens.ids) == prompt
    lps = list(gen.prefill_tokens.logprobs)
    with torch.no_grad():
        logp = hf(torch.tensor([prompt])).logits[0].log_softmax(-1)
    assert math.isnan(lps[0])
    assert lps[1:] == pytest.approx([logp[i, prompt[i + 1]].item() for i in range(len(prompt) - 1)], abs=1e-4)
    assert status_of(lambda: router.decode(client, [pb.CachedBatch(id=4)])) == NOT_FOUND


def test_cached_prefix_request(shard, router):
    """The router's prefix cache: request 41 reuses two full blocks of request 40."""
    client, hf, *_ = shard
    base = [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17]
    prefill(client, 5, router.request(40, base, 3))
    other = base[:8] + [200, 201, 202]
    req = router.request(41, other, 6, cache_len=8, shared=router.tables[40][:2], ignore_eos=True)
    resp = prefill(client, 6, req)
    out: dict = {}
    collect(resp.generations, out)
    while resp.HasField("batch"):
        resp = router.decode(client, [resp.batch])
        collect(resp.generations, out)
    assert out[41]["ids"] == hf_greedy(hf, other, 6)


def test_filter_and_clear(shard, router):
    client, *_ = shard
    reqs = [router.request(r, [4 + r, 5, 6, 7, 8], 20, ignore_eos=True) for r in (50, 51, 52)]
    batch = prefill(client, 7, *reqs).batch
    batch = router.decode(client, [batch]).batch
    kept = client.FilterBatch(pb.FilterBatchRequest(batch_id=7, request_ids=[52, 50])).batch
    assert kept.id == 7 and list(kept.request_ids) == [50, 52]
    resp = router.decode(client, [kept])
    assert [g.request_id for g in resp.generations] == [50, 52]
    unknown = pb.FilterBatchRequest(batch_id=7, request_ids=[51])  # filtered out already
    assert status_of(lambda: client.FilterBatch(unknown)) == grpc.StatusCode.INVALID_ARGUMENT
    assert status_of(lambda: client.FilterBatch(pb.FilterBatchRequest(batch_id=99, request_ids=[1]))) == NOT_FOUND
    empty = client.FilterBatch(pb.FilterBatchRequest(batch_id=7, request_ids=[])).batch
    assert empty.id == 7 and not empty.request_ids
    assert status_of(lambda: router.decode(client, [kept])) == NOT_FOUND  # dropped

    batch = prefill(client, 8, router.request(53, [9, 9, 9], 5)).batch
    client.ClearCache(pb.ClearCacheRequest(batch_id=8))
    client.ClearCache(pb.ClearCacheRequest(batch_id=8))  # unknown id: no-op
    assert status_of(lambda: router.decode(client, [batch])) == NOT_FOUND


def test_bad_input_gets_a_status_not_a_crash(shard, router):
    client, hf, *_ = shard
    prompt = [21, 22, 23, 24, 25]
    batch = prefill(client, 9, router.request(60, prompt, 8, ignore_eos=True)).batch
    first = list(batch.request_ids)

    def decode_with(mutate) -> grpc.StatusCode:
        slots = router.slots([60])
        mutate(slots[0])
        return status_of(lambda: client.Decode(pb.DecodeRequest(batches=[batch], slots=slots)))

    invalid = grpc.StatusCode.INVALID_ARGUMENT
    assert decode_with(lambda s: s.slots.__setitem__(0, s.slots[0] + 1)) == invalid  # wrong offset
    assert decode_with(lambda s: s.block_table.__setitem__(-1, 10**6)) == invalid  # no such block
    assert decode_with(lambda s: s.block_table.__setitem__(0, 0)) == invalid  # scratch block
    assert decode_with(lambda s: s.block_table.__setitem__(0, s.block_table[1])) == invalid  # repeated block
    assert decode_with(lambda s: s.block_table.__setitem__(0, router.free[0])) == invalid  # changed history
    assert decode_with(lambda s: s.slots.append(s.slots[0])) == invalid  # two slots
    assert decode_with(lambda s: setattr(s, "request_id", 61)) == invalid  # wrong request
    assert status_of(lambda: client.Decode(pb.DecodeRequest(batches=[batch], slots=[]))) == invalid
    assert status_of(lambda: client.Decode(pb.DecodeRequest(batches=[]))) == invalid
    twice = pb.DecodeRequest(batches=[batch, batch], slots=router.slots([60]))
    assert status_of(lambda: client.Decode(twice)) == invalid

    def bad_prefill(**kw) -> grpc.StatusCode:
        req = router.request(70, [1, 2, 3, 4, 5, 6], 4)
        for k, v in kw.items():
            value = getattr(req, k)
            if hasattr(value, "CopyFrom"):  # message field
                value.CopyFrom(v)
            elif isinstance(v, list):  # repeated field
                del value[:]
                value.extend(v)
            else:
                setattr(req, k, v)
        return status_of(lambda: client.Prefill(pb.PrefillRequest(batch=pb.Batch(id=10, requests=[req]))))

    assert bad_prefill(slots=[1, 2]) == invalid
    assert bad_prefill(input_ids=[1, 2, 3, 4, 5, 6, 1000]) == invalid  # > vocab (and table too short)
    assert bad_prefill(cache_len=6) == invalid
    assert bad_prefill(parameters=pb.NextTokenChooserParameters(temperature=-1.0)) == invalid
    assert bad_prefill(stopping_parameters=pb.StoppingCriteriaParameters(max_new_tokens=0)) == invalid
    dup = pb.Batch(id=11, requests=[router.request(71, [1, 2], 2), router.request(71, [1, 2], 2)])
    assert status_of(lambda: client.Prefill(pb.PrefillRequest(batch=dup))) == invalid
    again = pb.Batch(id=9, requests=[router.request(72, [1, 2], 2)])
    assert status_of(lambda: client.Prefill(pb.PrefillRequest(batch=again))) == grpc.StatusCode.ALREADY_EXISTS

    # Nothing above changed the cached batch: it still decodes to the reference tokens.
    client.Health(pb.HealthRequest())
    out: dict = {}
    resp = router.decode(client, [batch])
    assert list(resp.batch.request_ids) == first
    collect(resp.generations, out)
    assert out[60]["ids"] == hf_greedy(hf, prompt, 2)[1:]


def test_seeded_sampling_is_reproducible(shard, router):
    client, *_ = shard
    params = pb.NextTokenChooserParameters(do_sample=True, temperature=1.0, top_p=0.95, seed=42, has_seed=True)

    def run(batch_id: int, rid: int, companions: int) -> list[int]:
        reqs = [router.request(rid, [5, 6, 7], 6, ignore_eos=True, params=params)]
        unseeded = pb.NextTokenChooserParameters(do_sample=True)
        reqs += [router.request(rid + 1 + i, [8, 9], 6, ignore_eos=True, params=unseeded) for i in range(companions)]
        resp = prefill(client, batch_id, *reqs)
        out: dict = {}
        collect(resp.generations, out)
        while resp.HasField("batch"):
            resp = router.decode(client, [resp.batch])
            collect(resp.generations, out)
        return out[rid]["ids"]

    assert run(12, 80, 0) == run(13, 90, 3)


def test_stale_regular_file_is_not_replaced(tmp_path):
    path = tmp_path / "not-a-socket"
    path.write_text("precious")
    with pytest.raises(FileExistsError, match="not a socket"):
        _remove_stale_socket(str(path))
    assert path.read_text() == "precious"


def test_health_fails_once_a_forward_broke(tmp_path):
    from pagemill.config import ShardConfig
    from pagemill.shard.engine import ModelRunner
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
    batch = runner.new_batch(pb.Batch(id=1, requests=[FakeRouter(64).request(1, [1, 2, 3], 4)]))
    runner.model.model.embed_tokens = None  # sabotage: the forward now raises
    with pytest.raises(TypeError):
        runner.prefill(batch)
    with pytest.raises(ShardError) as e:
        runner.health()
    assert e.value.code == grpc.StatusCode.UNAVAILABLE and "TypeError" in e.value.message
