"""LoRA adapters on the other native architectures (their projections under the same names, or
Phi-3's fused ones) and over two tensor-parallel ranks, against PEFT's merged model."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from conftest import build_model_dir
from pagemill.bench.block_router import BlockRouter
from pagemill.proto import pb
from pagemill.shard.model_runner import ModelRunner
from test_lora import ALL, BLOCK, NEW, PROMPTS, assert_matches, make_adapter, make_runner, merged, reference


def _variants(module: str) -> dict:
    import importlib

    return importlib.import_module(module).VARIANTS


ATTN = ["q_proj", "k_proj", "v_proj", "o_proj"]
# Architectures whose linears map to the same names (Phi-3: its own fused names, split across
# our fused rows as its checkpoint is); the MoE model's experts are not adaptable, its attention is.
ARCHS = {
    "qwen2_bias_sharded": ("conftest", ALL),
    "qwen3_bias": ("test_models_breadth", ALL),
    "phi3": ("test_models_breadth", ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]),
    "gemma3": ("test_gemma", ALL),
    "mixtral": ("test_models_moe", ATTN),
}


@pytest.mark.parametrize("arch", list(ARCHS))
def test_other_architectures_match_peft(arch, tmp_path):
    module, targets = ARCHS[arch]
    path = build_model_dir(str(tmp_path / "model"), arch, variants=_variants(module))
    adapter = make_adapter(path, str(tmp_path / "adapter"), 8, 16, True, targets, seed=7)
    runner = make_runner(path, max_loras=1, cpu_kernels=True)
    router = BlockRouter.for_runner(runner)
    plan = [(None, 0), (adapter, 1), (adapter, 0)]
    for rid, (a, p) in enumerate(plan):
        router.add(rid, PROMPTS[p], NEW, ignore_eos=True, adapter=pb.Adapter(id=1, name="a", path=a) if a else None)
    outs = router.run()
    hf = {None: merged(path, None), adapter: merged(path, adapter)}
    for rid, (a, p) in enumerate(plan):
        assert_matches(outs[rid], reference(hf[a], PROMPTS[p], NEW))


def test_moe_experts_are_not_adaptable(tmp_path):
    path = build_model_dir(str(tmp_path / "model"), "qwen2_moe", variants=_variants("test_models_moe"))
    adapter = make_adapter(path, str(tmp_path / "adapter"), 8, 16, False, ["down_proj"], seed=7)
    router = BlockRouter.for_runner(make_runner(path, max_loras=1))
    router.add(0, PROMPTS[0], 2, adapter=pb.Adapter(id=1, name="a", path=adapter))
    err = router.run()[0].error
    # Per-expert linears (transformers 4) or one fused experts tensor (transformers 5): refused either way.
    assert "has no adaptable linear in this model" in err or "target module experts" in err, err


def _tp_generate(group, model_dir: str, adapters: list[str]) -> dict:
    """One batch, the base and each adapter, through a ModelRunner on this tensor-parallel rank;
    plus one more adapter that only rank 0 fails to read."""
    import pagemill.lora.pool as pool_module
    from pagemill.config import ShardConfig
    from pagemill.lora.adapter import AdapterError

    read = pool_module.read_adapter

    def read_on_this_rank(path: str, max_rank: int):
        if group.rank == 0 and path == adapters[0] + "-unreadable-on-rank-0":
            raise AdapterError(f"adapter {path} is unreadable here")
        return read(adapters[0] if path.startswith(adapters[0]) else path, max_rank)

    pool_module.read_adapter = read_on_this_rank

    cfg = ShardConfig(model_dir=model_dir, uds_path="unused", rank=group.rank, world_size=group.world_size,
                      block_size=BLOCK, kv_cache_memory=2 << 20, dtype="float32")  # fmt: skip
    runner = ModelRunner.from_shard_config(cfg, group)
    runner.warmup(pb.WarmupRequest(max_batch_prefill_tokens=64, max_input_tokens=32, max_total_tokens=64,
                                   max_batch_size=8, max_loras=len(adapters) + 1, max_lora_rank=16))  # fmt: skip
    router = BlockRouter.for_runner(runner)
    router.add(0, PROMPTS[0], NEW, ignore_eos=True)
    for i, a in enumerate(adapters, start=1):
        router.add(i, PROMPTS[i], NEW, ignore_eos=True, adapter=pb.Adapter(id=i, name=str(i), path=a))
    router.add(9, PROMPTS[4], NEW, ignore_eos=True,
               adapter=pb.Adapter(id=9, name="flaky", path=adapters[0] + "-unreadable-on-rank-0"))  # fmt: skip
    return {rid: (o.ids, o.logprobs, o.error) for rid, o in router.run().items()}


@pytest.mark.parametrize("arch", ["llama_uneven_tp", "phi3"])
def test_tensor_parallel_ranks_slice_adapters_like_the_base(arch, tmp_path):
    """2 gloo ranks with uneven head and feature splits: B's rows sliced on column-parallel
    linears, A's columns on row-parallel ones (their partial products summed by the base's
    all-reduce); both ranks return PEFT's tokens. An adapter one rank cannot read fails its
    request on both (else their collectives would not match)."""
    from test_parallel import VARIANTS as TP_VARIANTS, run_ranks

    variants = {**TP_VARIANTS, **_variants("test_models_breadth")}
    path = build_model_dir(str(tmp_path / "model"), arch, variants=variants)
    targets = ARCHS["phi3"][1] if arch == "phi3" else ALL
    adapters = [make_adapter(path, str(tmp_path / f"a{r}"), r, 16, r == 16, targets, seed=r) for r in (8, 16)]
    r0, r1 = run_ranks(_tp_generate, path, adapters)
    assert r0 == r1
    assert r0[9][2] == "adapter 'flaky' failed to load on tensor-parallel rank(s) [0]" and not r0[9][0]
    for rid, a in enumerate([None, *adapters]):
        ids, lps, error = r0[rid]
        got = SimpleNamespace(ids=ids, logprobs=lps, error=error)
        assert_matches(got, reference(merged(path, a), PROMPTS[rid], NEW))
