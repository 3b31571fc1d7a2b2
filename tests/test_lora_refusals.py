"""LoRA adapters the shard cannot serve: each fails its own request with the reason (the rest
of the step runs as without it), or is refused by name when read; Warmup's refusals and the
adapters' room in the KV budget."""

from __future__ import annotations

import json
import os

import pytest
import torch

from conftest import build_model_dir
from pagemill.bench.block_router import BlockRouter
from pagemill.lora.adapter import AdapterError, read_adapter
from pagemill.models.loader import load_model
from pagemill.proto import pb
from pagemill.shard.errors import ShardError
from pagemill.shard.model_runner import ModelRunner
from test_lora import (BLOCK, IDS, NEW, PROMPTS, adapter_pb, adapters, assert_matches, make_adapter, make_runner,
                       model_dir, refs)  # noqa: F401 (fixtures)  # fmt: skip


def edited_copy(src: str, dst: str, config: dict | None = None, drop: str | None = None) -> str:
    """A copy of adapter `src` with adapter_config.json fields replaced, or a file left out."""
    os.makedirs(dst)
    for f in os.listdir(src):
        if f != drop:
            with open(os.path.join(src, f), "rb") as i, open(os.path.join(dst, f), "wb") as o:
                o.write(i.read())
    if config:
        path = os.path.join(dst, "adapter_config.json")
        with open(path) as f:
            cfg = json.load(f)
        with open(path, "w") as f:
            json.dump({**cfg, **config}, f)
    return dst


def test_an_adapter_that_cannot_be_served_fails_its_request_alone(model_dir, adapters, refs, tmp_path):
    """Adapters off, a bad path, a rank over the limit: the request gets the reason as its error
    and no tokens; the rest of the step is computed as without it."""
    off = make_runner(model_dir, max_loras=0)
    router = BlockRouter.for_runner(off)
    router.add(0, PROMPTS[0], NEW, ignore_eos=True)
    router.add(1, PROMPTS[1], NEW, ignore_eos=True, adapter=adapter_pb(adapters, "all8"))
    outs = router.run()
    assert "max_loras=0" in outs[1].error and not outs[1].ids
    assert_matches(outs[0], refs[None, 0])

    runner = make_runner(model_dir, max_loras=2, max_rank=8)
    router = BlockRouter.for_runner(runner)
    router.add(0, PROMPTS[0], NEW, ignore_eos=True, adapter=adapter_pb(adapters, "all8"))
    router.add(1, PROMPTS[1], NEW, ignore_eos=True, adapter=pb.Adapter(id=90, name="gone", path=str(tmp_path / "no")))
    router.add(2, PROMPTS[2], NEW, ignore_eos=True, adapter=adapter_pb(adapters, "attn16"))  # rank 16 > 8
    router.add(3, PROMPTS[3], NEW, ignore_eos=True)
    outs = router.run()
    assert "is not a directory" in outs[1].error and not outs[1].ids
    assert "rank 16 is larger than the server's max LoRA rank 8" in outs[2].error and not outs[2].ids
    assert_matches(outs[0], refs["all8", 0])
    assert_matches(outs[3], refs[None, 3])
    assert list(runner.adapters.resident) == [IDS["all8"]]  # failures take no room
    assert not runner.requests


@pytest.mark.parametrize("change, message", [
    (dict(config={"use_dora": True}), "DoRA"),
    (dict(config={"rank_pattern": {"q_proj": 4}}), "rank_pattern"),
    (dict(config={"bias": "all"}), "trained biases"),
    (dict(config={"modules_to_save": ["lm_head"]}), "modules_to_save"),
    (dict(config={"r": 0}), "rank r=0"),
    (dict(config={"r": 4}), "not rank r=4"),
    (dict(config={"peft_type": "IA3"}), "not LORA"),
    (dict(drop="adapter_model.safetensors"), "has no adapter_model.safetensors"),
    (dict(drop="adapter_config.json"), "has no adapter_config.json"),
])  # fmt: skip
def test_unsupported_adapters_are_refused_by_name(adapters, tmp_path, change, message):
    bad = edited_copy(adapters["all8"], str(tmp_path / "bad"), **change)
    with pytest.raises(AdapterError, match=message):
        read_adapter(bad, 64)


def test_unsupported_target_modules_and_shape_mismatch(model_dir, adapters, tmp_path):
    from safetensors.torch import load_file, save_file

    from pagemill.lora.layers import fit_adapter, install

    src = adapters["all8"]
    tensors = load_file(os.path.join(src, "adapter_model.safetensors"))
    lm_head = {**tensors, "base_model.model.lm_head.lora_A.weight": torch.zeros(8, 64),
               "base_model.model.lm_head.lora_B.weight": torch.zeros(320, 8)}  # fmt: skip
    bad = edited_copy(src, str(tmp_path / "lm_head"))
    save_file(lm_head, os.path.join(bad, "adapter_model.safetensors"))
    with pytest.raises(AdapterError, match="target module lm_head .* is not supported"):
        read_adapter(bad, 64)
    # An adapter trained for another base: the same names, other widths.
    other = build_model_dir(str(tmp_path / "wide"), "mistral_head_dim")
    wide = make_adapter(other, str(tmp_path / "wide_adapter"), 8, 16, False, ["q_proj"], seed=0)
    model, _ = load_model(model_dir, cpu_kernels=False)
    install(model)
    with pytest.raises(AdapterError, match="q_proj maps 64 -> 64 features"):
        fit_adapter(model, read_adapter(wide, 64), 1, "wide", torch.float32, torch.device("cpu"))


def test_warmup_refuses_what_adapters_cannot_run_on(model_dir):
    model, config = load_model(model_dir, cpu_kernels=False)
    runner = ModelRunner(model, config, block_size=BLOCK, kv_cache_memory=1 << 16)
    warm = dict(max_batch_prefill_tokens=16, max_input_tokens=16, max_total_tokens=32, max_batch_size=2)
    with pytest.raises(ShardError, match="max_lora_rank must be > 0"):
        runner.warmup(pb.WarmupRequest(**warm, max_loras=2, max_lora_rank=0))
    with pytest.raises(ShardError, match="all of the KV cache memory"):
        runner.warmup(pb.WarmupRequest(**warm, max_loras=64, max_lora_rank=64))
    # The adapters' room comes out of the pool's budget.
    runner.kv_cache_memory = 4 << 20
    blocks = {n: runner.warmup(pb.WarmupRequest(**warm, max_loras=n, max_lora_rank=16)).num_blocks for n in (0, 4)}
    from pagemill.lora.layers import reserved_bytes

    per_block = 2 * 2 * 2 * 16 * BLOCK * 4  # K and V, 2 layers, 2 kv heads of 16, float32
    assert blocks[0] - blocks[4] == -(-reserved_bytes(model, 4, 16, torch.float32) // per_block)
