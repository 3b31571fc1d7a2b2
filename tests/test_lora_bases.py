"""LoRA adapters over bases whose linears are not plain float weights (--quantize int8, a GGUF
kept in its blocks) and under --batch-invariant."""

from __future__ import annotations

import pytest
import torch

from conftest import build_model_dir
from pagemill.models.loader import load_model
from pagemill.proto import pb
from pagemill.shard.model_runner import ModelRunner
from test_lora import (ALL, BLOCK, adapter_pb, adapters, make_adapter, make_runner, model_dir,  # noqa: F401
                       run_one_batch)  # fmt: skip


def test_int8_linears_take_adapters(model_dir, adapters):
    """--quantize int8: the base product is the int8 linear's, the adapters' products are added
    to it exactly (a forward hook); a request's output does not depend on its batch."""
    from pagemill.lora.apply import build_batch
    from pagemill.models.quantized_linear import QuantizedLinear

    runner = make_runner(model_dir, max_loras=2, cpu_kernels=True, quantize="int8")
    a = adapter_pb(adapters, "all8")
    loaded = runner.adapters.acquire(a, ())
    for name in ("self_attn.qkv_proj", "mlp.down_proj"):
        lin = runner.model.model.layers[1].get_submodule(name)
        assert isinstance(lin, QuantizedLinear)
        x = torch.randn(5, lin.in_features, generator=torch.Generator().manual_seed(0))
        base = lin(x)
        ctx = runner.model.lora_context
        ctx.batch = build_batch([None, loaded, None, loaded, None], [1] * 5, "cpu")
        try:
            adapted = lin(x)
        finally:
            ctx.batch = None
        w = loaded.modules[f"model.layers.1.{name}"]
        want = base.clone()
        want[[1, 3]] += (x[[1, 3]] @ w.a.T) @ w.b.T
        torch.testing.assert_close(adapted, want, atol=1e-6, rtol=1e-6)
        assert not torch.equal(adapted, base)
    alone = run_one_batch(runner, [(a, 2)])[0]
    mixed = run_one_batch(runner, [(None, 0), (adapter_pb(adapters, "attn16"), 1), (a, 2)])[2]
    assert alone.ids == mixed.ids and not alone.error
    torch.testing.assert_close(alone.logprobs, mixed.logprobs, atol=1e-5, rtol=0)


def test_gguf_blocks_take_adapters(tmp_path):
    """A GGUF kept in its quantized blocks (a forward hook on GGUFLinear) serves an adapter as the
    same file dequantized to float32 does (PackedLinear), which the tests above hold to PEFT. On the
    blocks' torch reference, which computes what the dequantized weights do (the compiled kernels
    quantize activations too: a base difference, not the adapters')."""
    from gguf import GGMLQuantizationType as T
    from gguf_vocab import byte_level_vocab
    from gguf_writer import write_gguf

    from pagemill.models.gguf.linear import GGUFLinear

    hf_dir = build_model_dir(str(tmp_path / "hf"), "q", variants={"q": ("Qwen2Config", dict(
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2), {})})  # fmt: skip
    gguf = str(write_gguf(hf_dir, tmp_path / "tiny.gguf", byte_level_vocab(320), T.Q8_0)[0])
    adapter = pb.Adapter(id=3, name="a", path=make_adapter(hf_dir, str(tmp_path / "a"), 16, 16, True, ALL, seed=3))
    plan = [(None, 0), (adapter, 1), (adapter, 2)]
    outs = {}
    for weights in ("quantized", "dequantized"):
        model, config = load_model(gguf, "float32", "cpu", cpu_kernels=False, gguf_weights=weights)
        assert any(isinstance(m, GGUFLinear) for m in model.modules()) == (weights == "quantized")
        runner = ModelRunner(model, config, block_size=BLOCK, kv_cache_memory=4 << 20)
        runner.warmup(pb.WarmupRequest(max_batch_prefill_tokens=64, max_input_tokens=32, max_total_tokens=64,
                                       max_batch_size=8, max_loras=1, max_lora_rank=16))  # fmt: skip
        outs[weights] = run_one_batch(runner, plan)
    for rid in range(len(plan)):
        q, d = outs["quantized"][rid], outs["dequantized"][rid]
        assert q.ids == d.ids and not q.error
        torch.testing.assert_close(q.logprobs, d.logprobs, atol=1e-4, rtol=0)
    assert outs["quantized"][1].ids != run_one_batch(runner, [(None, 1)])[0].ids  # the adapter changes them


def test_batch_invariant_adapter_rows_alone_equal_in_a_crowd(model_dir, adapters):
    """--batch-invariant: the low-rank products run on the same fixed-shape row tiles as the base
    linears, so an adapter request's bits do not depend on its batch. float32: here MKL takes
    another path for one row than for several, so plain products would move bits."""
    from pagemill.config import ShardConfig

    runner = ModelRunner.from_shard_config(ShardConfig(model_dir=model_dir, uds_path="", dtype="float32",
                                                       batch_invariant=True, kv_cache_memory=4 << 20))  # fmt: skip
    runner.warmup(pb.WarmupRequest(max_batch_prefill_tokens=256, max_input_tokens=64, max_total_tokens=128,
                                   max_batch_size=16, max_loras=3, max_lora_rank=16))  # fmt: skip
    a = adapter_pb(adapters, "attn16")
    alone = run_one_batch(runner, [(a, 2)])[0]
    crowd = [(adapter_pb(adapters, "all8"), 0), (None, 1), (a, 3), (adapter_pb(adapters, "mlp8_rslora"), 4)] * 3
    mixed = run_one_batch(runner, crowd + [(a, 2)])[len(crowd)]
    assert alone.ids == mixed.ids and alone.logprobs == mixed.logprobs


@pytest.mark.parametrize("name", ["llama", "gemma3_q8_0"])
def test_fused_gguf_layers_give_way_to_adapter_steps(name, tmp_path):
    """A GGUF kept in its blocks decodes through the compiled whole-layer decoder (Llama's and
    Gemma 3's), which knows no adapters: a step with adapter rows must take the per-op path, so
    the outputs equal those of the same model with the fused decoder off."""
    from test_gguf_fused_decode import FUSED, _kernels_or_skip
    from test_gguf_archs import write_variant

    _kernels_or_skip()
    hf_dir, path = write_variant(tmp_path, name, FUSED)
    adapter = pb.Adapter(id=5, name="a", path=make_adapter(hf_dir, str(tmp_path / "a"), 8, 16, False, ALL, seed=5))
    plan = [(None, 0), (adapter, 1), (adapter, 2)]
    outs = {}
    for fused in (True, False):
        model, config = load_model(str(path), "float32", "cpu", cpu_kernels=True)
        assert model.model.fused is not None, "the fused GGUF decoder applies to this file"
        if not fused:
            model.model.fused = None
        runner = ModelRunner(model, config, block_size=BLOCK, kv_cache_memory=4 << 20, cpu_kernels=True)
        runner.warmup(pb.WarmupRequest(max_batch_prefill_tokens=64, max_input_tokens=32, max_total_tokens=64,
                                       max_batch_size=8, max_loras=1, max_lora_rank=8))  # fmt: skip
        outs[fused] = run_one_batch(runner, plan)
    for rid in range(len(plan)):
        assert outs[True][rid].ids == outs[False][rid].ids and not outs[True][rid].error, f"request {rid}"
        torch.testing.assert_close(outs[True][rid].logprobs, outs[False][rid].logprobs, atol=1e-3, rtol=0)
