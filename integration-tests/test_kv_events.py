"""KV-cache events (`--kv-events-config`) as a consumer sees them: a real
server on the tiny model, subscribed with pyzmq, batches decoded with msgpack.
Hashes are checked against an independent computation of what the consumers
compare: llm-d's block keys (SHA-256 of canonical CBOR, here with `cbor2`)
and vllm-router's per-block digest of the token ids; then evictions, the
sequence numbers and a replay (docs/kv_cache.md, "KV-cache events")."""

import hashlib
import json
import time

import cbor2
import httpx
import msgpack
import pytest
import zmq

from reliability import stopped_after
from server import free_port, launch

BS = 16
# The tiny model's block is 8 KiB (2 layers x K,V x 2 heads x 16 dims x 16 tokens x 4 bytes):
# 64 blocks, a few prompts' worth, so that new prompts evict old ones.
POOL = ("--block-size", str(BS), "--kv-cache-memory", "512KiB", "--max-input-tokens", "400",
        "--max-total-tokens", "512")


def llm_d_keys(tokens: list[int], seed: str = "") -> list[int]:
    """llm-d's ChunkedTokenDatabase: low 64 bits of SHA-256(CBOR([parent, block, None]))."""
    def low64(obj) -> int:
        return int.from_bytes(hashlib.sha256(cbor2.dumps(obj, canonical=True)).digest()[-8:], "big")

    parent, keys = low64(seed), []
    for i in range(len(tokens) // BS):
        parent = low64([parent, tokens[i * BS:(i + 1) * BS], None])
        keys.append(parent)
    return keys


def vllm_router_digests(tokens: list[int]) -> list[bytes]:
    """vllm-router's index key of a block: SHA-256 of its token ids, little-endian u32."""
    return [hashlib.sha256(b"".join(t.to_bytes(4, "little") for t in tokens[i:i + BS])).digest()
            for i in range(0, len(tokens) - len(tokens) % BS, BS)]


class Subscriber:
    """A SUB socket collecting (topic, seq, decoded batch, raw payload)."""

    def __init__(self, endpoint: str, topic: bytes):
        self.sock = zmq.Context.instance().socket(zmq.SUB)
        self.sock.connect(endpoint)
        self.sock.setsockopt(zmq.SUBSCRIBE, topic)
        self.got: list[tuple[bytes, int, list, bytes]] = []

    def drain(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if self.sock.poll(100):
                topic, seq, payload = self.sock.recv_multipart()
                self.got.append((topic, int.from_bytes(seq, "big"), msgpack.unpackb(payload), payload))

    def events(self, kind: str) -> list[dict]:
        return [e for _, _, batch, _ in self.got for e in batch[1] if e["type"] == kind]


def _generate(url: str, prompt: str) -> None:
    r = httpx.post(f"{url}/generate", timeout=60, json={"inputs": prompt, "parameters": {"max_new_tokens": 2}})
    assert r.status_code == 200, r.text


def _ids(url: str, prompt: str) -> list[int]:
    r = httpx.post(f"{url}/tokenize", timeout=10, json={"inputs": prompt})
    return [t["id"] for t in r.json()]


def _prompt(k: int) -> str:
    return f"Document {k}. " + " ".join(f"fact {k}-{i} holds." for i in range(40))


@pytest.mark.timeout(150)
def test_events_name_the_prompts_blocks_as_consumers_hash_them_and_replay(tiny_model_dir):
    pub, replay = free_port(), free_port()
    config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{pub}",
              "replay_endpoint": f"tcp://*:{replay}", "topic": "kv@pod@tiny", "buffer_steps": 1000}
    s = launch(str(tiny_model_dir), *POOL, "--kv-events-config", json.dumps(config))
    with stopped_after(s):
        sub = Subscriber(f"tcp://127.0.0.1:{pub}", b"kv@")
        sub.drain(1.0)  # the subscription reaches the publisher before anything is published
        ids = _ids(s.url, _prompt(0))
        _generate(s.url, _prompt(0))
        sub.drain(1.5)
        stored = [e for e in sub.events("BlockStored") if e["medium"] == "GPU"]
        assert stored, sub.got
        first = stored[0]
        assert first["parent_block_hash"] is None and first["block_size"] == BS
        assert first["lora_id"] is None and first["lora_name"] is None
        hashes = [h for e in stored for h in e["block_hashes"]]
        tokens = [t for e in stored for t in e["token_ids"]]
        n = len(ids) // BS
        assert tokens[:n * BS] == ids[:n * BS], "the prompt's full blocks, in order"
        assert hashes[:n] == llm_d_keys(ids)[:n], "llm-d computes the same keys from the prompt"
        assert vllm_router_digests(tokens)[:n] == vllm_router_digests(ids), "vllm-router matches the prompt"
        # Each later event of the chain names the block before it as parent.
        for prev, e in zip(stored, stored[1:]):
            assert e["parent_block_hash"] == prev["block_hashes"][-1]

        # New prompts need the pool: the first prompt's blocks are evicted and said so.
        for k in range(1, 8):
            _generate(s.url, _prompt(k))
        sub.drain(1.5)
        removed = {h for e in sub.events("BlockRemoved") if e["medium"] == "GPU" for h in e["block_hashes"]}
        assert set(hashes[:n]) <= removed

        topics = {t for t, _, _, _ in sub.got}
        seqs = [q for _, q, _, _ in sub.got]
        assert topics == {b"kv@pod@tiny"} and seqs == list(range(seqs[0], seqs[0] + len(seqs)))
        assert all(isinstance(b[0], float) and b[2] == 0 for _, _, b, _ in sub.got), "[ts, events, rank]"

        # A subscriber that missed batches asks for them from a seq on: the same bytes, then the end marker.
        dealer = zmq.Context.instance().socket(zmq.DEALER)
        dealer.connect(f"tcp://127.0.0.1:{replay}")
        start = seqs[len(seqs) // 2]
        dealer.send_multipart([b"", start.to_bytes(8, "big")])
        replayed = []
        while dealer.poll(5000):
            empty, seq, payload = dealer.recv_multipart()
            assert empty == b""
            if int.from_bytes(seq, "big", signed=True) == -1:
                assert payload == b""
                break
            replayed.append((int.from_bytes(seq, "big"), payload))
        live = [(q, raw) for _, q, _, raw in sub.got if q >= start]
        assert replayed == live


@pytest.mark.timeout(60)
def test_a_bad_kv_events_config_is_a_startup_error(tiny_model_dir):
    with pytest.raises(RuntimeError, match="unknown field `endpont`"):
        launch(str(tiny_model_dir), "--kv-events-config", '{"enable_kv_cache_events": true, "endpont": "x"}')
