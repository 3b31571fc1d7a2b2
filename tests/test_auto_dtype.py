"""`--dtype auto` (the default): bfloat16 on a CPU with native bf16, float32 elsewhere."""

import pytest

from pagemill.cli import build_parser
from pagemill.config import ShardConfig
from pagemill.models import auto_dtype
from pagemill.models.auto_dtype import resolve_dtype


@pytest.mark.parametrize("flags,expected", [({"avx512f", "avx512_bf16"}, "bfloat16"),
                                            ({"amx_bf16", "amx_tile"}, "bfloat16"),
                                            ({"avx512f", "avx2"}, "float32"), (set(), "float32")])  # fmt: skip
def test_auto_picks_bf16_only_with_native_bf16(monkeypatch, flags, expected):
    monkeypatch.setattr(auto_dtype, "cpu_flags", lambda: flags)
    dtype, why = resolve_dtype("auto", "cpu")
    assert dtype == expected and why.startswith("auto")


def test_an_explicit_dtype_passes_through(monkeypatch):
    monkeypatch.setattr(auto_dtype, "cpu_flags", lambda: {"avx512_bf16"})
    assert resolve_dtype("float32", "cpu") == ("float32", "asked for")
    assert resolve_dtype("float16", "cpu")[0] == "float16"


def test_auto_is_the_default():
    for argv in (["launch"], ["shard", "--model-dir", "m", "--uds-path", "s"]):
        assert build_parser().parse_args(argv).dtype == "auto"
    assert ShardConfig(model_dir="m", uds_path="s").dtype == "auto"


def test_this_machine_reports_its_choice():
    dtype, why = resolve_dtype("auto", "cpu")
    has = bool(auto_dtype.cpu_flags() & set(auto_dtype.BF16_CPU_FLAGS))
    assert dtype == ("bfloat16" if has else "float32"), why


def test_the_shard_reports_the_resolved_dtype(llama_dir):
    """What the shard's Info (the router's /info model_dtype) says is the dtype it loaded."""
    import torch

    from pagemill.shard.model_runner import ModelRunner

    runner = ModelRunner.from_shard_config(ShardConfig(model_dir=llama_dir, uds_path="unused", block_size=4,
                                                       kv_cache_memory=1 << 20))  # fmt: skip
    expected = resolve_dtype("auto", "cpu")[0]
    assert runner.info().dtype == expected
    assert next(runner.model.parameters()).dtype == getattr(torch, expected)
