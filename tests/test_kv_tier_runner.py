"""The second KV tier inside ModelRunner (tiny model, disk store): warmup reports the
tier; a Step's kv_saves copy computed blocks out; a new runner over the same directory
(a restart) lists them, loads them into other blocks and continues the prompt from
there with the same next token and logprob as a full prefill; a corrupt file is
reported as a failed load."""

from __future__ import annotations

import os

import pytest
import torch

from conftest import build_model_dir
from pagemill.models.loader import load_model
from pagemill.proto import pb
from pagemill.shard.model_runner import ModelRunner
from pagemill.shard.kv_tier import TierOptions

BLOCK = 16
PROMPT = [(i * 37 + 11) % 250 + 3 for i in range(40)]  # 2 full blocks + 8 tokens


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_model_dir(str(tmp_path_factory.mktemp("tier")), "llama_gqa")


def runner(model_dir, kv_dir, kv_cache_dtype="auto") -> tuple[ModelRunner, pb.WarmupResponse]:
    model, config = load_model(model_dir)
    r = ModelRunner(model, config, block_size=BLOCK, kv_cache_memory=64 << 20, model_dir=model_dir,
                    kv_offload=TierOptions(str(kv_dir), 1 << 30, 0), kv_cache_dtype=kv_cache_dtype)  # fmt: skip
    w = r.warmup(pb.WarmupRequest(max_batch_prefill_tokens=64, max_input_tokens=48, max_total_tokens=64,
                                  max_batch_size=2))  # fmt: skip
    return r, w


def new_request(num_computed: int, blocks: list[int]) -> pb.StepRequest:
    params = pb.NextTokenChooserParameters(temperature=1.0, top_p=1.0, typical_p=1.0, repetition_penalty=1.0)
    new = pb.NewRequest(input_ids=PROMPT, parameters=params,
                        stopping_parameters=pb.StoppingCriteriaParameters(max_new_tokens=4, ignore_eos_token=True))
    return pb.StepRequest(requests=[pb.ScheduledRequest(
        id=1, new_request=new, num_computed=num_computed, num_tokens=len(PROMPT) - num_computed,
        new_block_ids=blocks)])  # fmt: skip


def sampled(result) -> tuple[int, float]:
    g = result.generations[0]
    assert not g.error, g.error
    return g.tokens.ids[0], g.tokens.logprobs[0]


@pytest.mark.parametrize("kv", ["auto", "int8"])  # int8: the rows' scales travel with the blocks
def test_saved_blocks_survive_a_restart_and_replace_the_prefill(model_dir, tmp_path, kv):
    kv_dir = tmp_path / "kv"
    a, w = runner(model_dir, kv_dir, kv)
    assert w.kv_tier.kind == "disk" and len(w.kv_tier.namespace) == 32 and list(w.kv_tier.keys) == []
    assert w.kv_tier.load_bytes_per_s > 0 and w.kv_tier.prefill_tokens_per_s > 0
    assert w.kv_tier.capacity_blocks == (1 << 30) // w.kv_tier.block_bytes
    full = sampled(a.step(new_request(0, [1, 2, 3])))
    keys = ["a" * 32, "b" * 32]
    out = a.step(pb.StepRequest(finished_ids=[1], kv_saves=[pb.KvSave(block_id=1, key=keys[0]),
                                                           pb.KvSave(block_id=2, key=keys[1])]))  # fmt: skip
    assert out.tier.failed_loads == [] and out.tier.lost == []
    a.store.flush()

    namespace = w.kv_tier.namespace
    b, w = runner(model_dir, kv_dir, kv)  # a restart over the same directory
    assert sorted(w.kv_tier.keys) == keys and w.kv_tier.namespace == namespace
    out = b.step(pb.StepRequest(kv_loads=[pb.KvLoad(key=keys[0], block_id=7), pb.KvLoad(key=keys[1], block_id=8)]))
    assert out.tier.failed_loads == []
    assert b.pool.storage[:, :, 7].equal(a.pool.storage[:, :, 1])
    token, logprob = sampled(b.step(new_request(2 * BLOCK, [7, 8, 9])))
    assert token == full[0]
    # int8: the 8-row chunk's float rounding differs from the 40-row prefill's by ~1e-6, which can
    # move an entry of the new tokens' k/v across an int8 rounding boundary (one step: absmax / 127).
    assert logprob == pytest.approx(full[1], abs=1e-4 if kv == "auto" else 0.05)


def test_a_corrupt_file_is_a_failed_load(model_dir, tmp_path):
    kv_dir = tmp_path / "kv"
    a, _ = runner(model_dir, kv_dir)
    a.step(new_request(0, [1, 2, 3]))
    a.step(pb.StepRequest(finished_ids=[1], kv_saves=[pb.KvSave(block_id=1, key="c" * 32)]))
    a.store.flush()
    path = os.path.join(kv_dir, "c" * 32 + ".kv")
    data = bytearray(open(path, "rb").read())
    data[-1] ^= 0x01
    open(path, "wb").write(bytes(data))
    b, w = runner(model_dir, kv_dir)
    assert list(w.kv_tier.keys) == ["c" * 32]  # the header is intact: indexed, checked at load
    before = b.pool.storage[:, :, 4].clone()
    out = b.step(pb.StepRequest(kv_loads=[pb.KvLoad(key="c" * 32, block_id=4)]))
    assert out.tier.failed_loads == ["c" * 32] and out.tier.lost == ["c" * 32]
    assert b.pool.storage[:, :, 4].equal(before), "nothing of a corrupt file reaches the pool"
    assert not torch.isnan(b.pool.storage).any()


def test_another_model_does_not_see_the_files(model_dir, tmp_path_factory, tmp_path):
    kv_dir = tmp_path / "kv"
    a, _ = runner(model_dir, kv_dir)
    a.step(new_request(0, [1, 2, 3]))
    a.step(pb.StepRequest(finished_ids=[1], kv_saves=[pb.KvSave(block_id=1, key="d" * 32)]))
    a.store.flush()
    other_dir = build_model_dir(str(tmp_path_factory.mktemp("other")), "llama_gqa", seed=1)
    _, w = runner(other_dir, kv_dir)
    assert list(w.kv_tier.keys) == []


def test_another_kv_dtype_does_not_see_the_files(model_dir, tmp_path):
    kv_dir = tmp_path / "kv"
    a, w = runner(model_dir, kv_dir)
    a.step(new_request(0, [1, 2, 3]))
    a.step(pb.StepRequest(finished_ids=[1], kv_saves=[pb.KvSave(block_id=1, key="e" * 32)]))
    a.store.flush()
    b, w8 = runner(model_dir, kv_dir, "int8")
    assert list(w8.kv_tier.keys) == [] and w8.kv_tier.namespace != w.kv_tier.namespace
