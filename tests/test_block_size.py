"""`--block-size 0` (the default): 64-token KV blocks on the CPU, 16 on CUDA."""

import pytest

from pagemill.cli import build_parser
from pagemill.config import ShardConfig
from pagemill.shard.kv_pool import CPU_BLOCK_SIZE, CUDA_BLOCK_SIZE, resolve_block_size


def test_auto_is_the_default():
    for argv in (["launch"], ["shard", "--model-dir", "m", "--uds-path", "s"]):
        assert build_parser().parse_args(argv).block_size == 0
    assert ShardConfig(model_dir="m", uds_path="s").block_size == 0


def test_auto_resolves_per_device_and_a_given_size_passes_through():
    assert (CPU_BLOCK_SIZE, CUDA_BLOCK_SIZE) == (64, 16)
    assert resolve_block_size(0, "cpu") == 64
    assert resolve_block_size(0, "cuda") == 16
    assert resolve_block_size(32, "cpu") == 32 and resolve_block_size(4, "cuda") == 4


def test_a_negative_size_is_refused():
    with pytest.raises(ValueError, match="--block-size must be positive"):
        resolve_block_size(-16, "cpu")


def test_the_shard_reports_the_resolved_size(llama_dir):
    """What the shard tells the router at warmup (and /info's block_size) is the resolved size."""
    from pagemill.proto import pb
    from pagemill.shard.model_runner import ModelRunner

    runner = ModelRunner.from_shard_config(ShardConfig(model_dir=llama_dir, uds_path="unused", dtype="float32",
                                                       kv_cache_memory=1 << 22))  # fmt: skip
    assert runner.block_size == 64 and runner.info().block_size == 64
    warm = runner.warmup(pb.WarmupRequest(max_batch_prefill_tokens=64, max_input_tokens=32, max_total_tokens=64,
                                          max_batch_size=4))  # fmt: skip
    assert warm.block_size == 64 and warm.num_blocks == runner.pool.num_blocks
