"""Decode CUDA graphs (shard/cuda_graphs.py): buckets, padded static buffers, capture.

On CPU the static-buffer forward (the function that is captured on CUDA)
runs eagerly: same buffers, same padding, same static metadata. It must give
the logits of the normal decode path for batches between buckets, mixed
context lengths and tables narrower than the static width, and its padding
rows must never write outside scratch block 0. The capture test needs CUDA.
"""

from __future__ import annotations

import random

import pytest
import torch

from conftest import build_model_dir
from pagemill.attention.backend import select_backend
from pagemill.attention.metadata import make_metadata
from pagemill.models.loader import load_model
from pagemill.proto import pb
from pagemill.shard.step_inputs import StepInputs
from pagemill.shard.cuda_graphs import MAX_GRAPH_BATCH, DecodeGraphs, graph_batch_sizes, select_bucket
from pagemill.shard.model_runner import ModelRunner
from pagemill.bench.block_router import Blocks
from pagemill.shard.kv_pool import KVPool

BLOCK = 4
MAX_TOTAL = 64  # static tables of 16 blocks


def test_bucket_sizes():
    assert graph_batch_sizes(256) == [1, 2, 4, 8, *range(16, 257, 8)]
    assert len(graph_batch_sizes(256)) == 35
    assert graph_batch_sizes(20) == [1, 2, 4, 8, 16, 20]  # max_batch_size is always a bucket
    assert graph_batch_sizes(8) == [1, 2, 4, 8]
    assert graph_batch_sizes(3) == [1, 2, 3]
    assert graph_batch_sizes(1) == graph_batch_sizes(0) == [1]
    assert graph_batch_sizes(1000)[-1] == MAX_GRAPH_BATCH


def test_bucket_selection():
    sizes = graph_batch_sizes(256)
    assert [select_bucket(sizes, b) for b in (1, 2, 3, 5, 8, 9, 16, 17, 100, 255, 256)] == [
        1, 2, 4, 8, 8, 16, 16, 24, 104, 256, 256,
    ]  # fmt: skip
    assert select_bucket(sizes, 257) is None  # wider than every graph: eager


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_model_dir(str(tmp_path_factory.mktemp("cg") / "m"), "llama_gqa")


class Setup:
    """A model, a pool and sequences prefilled into shuffled blocks (eagerly, the normal path)."""

    def __init__(self, model_dir, device="cpu", backend="torch", dtype=torch.float32, seed=0, kv_dtype=None):
        self.device = torch.device(device)
        self.model, self.config = load_model(model_dir, dtype, device, select_backend(backend, device))
        self.pool = KVPool.with_blocks(self.config, num_blocks=120, block_size=BLOCK, dtype=kv_dtype or dtype,
                                       device=device)  # fmt: skip
        self.blocks = Blocks(120, BLOCK, seed)
        self.rng = random.Random(seed)
        self.seqs: list[dict] = []

    def add(self, length: int) -> None:
        table = self.blocks.grow([], length + 1)  # room for the decoded token
        ids = [self.rng.randrange(self.config.vocab_size) for _ in range(length + 1)]
        slots = self.blocks.slots(table, 0, length)
        meta = make_metadata(is_prefill=True, query_lens=[length], kv_lens=[length], block_tables=[table],
                             slot_mapping=slots, device=self.device)  # fmt: skip
        with torch.inference_mode():
            self.model(torch.tensor(ids[:length], device=self.device), torch.arange(length, device=self.device),
                       meta, self.pool.kv_caches)  # fmt: skip
        self.seqs.append(dict(table=table, ids=ids, length=length))

    def decode_inputs(self, seqs) -> StepInputs:
        """The decode step that feeds each sequence's token `length` (as step_inputs.build_inputs builds it)."""
        meta = make_metadata(
            is_prefill=False, query_lens=[1] * len(seqs), kv_lens=[s["length"] + 1 for s in seqs],
            block_tables=[s["table"] for s in seqs],
            slot_mapping=[self.blocks.slots(s["table"], s["length"], s["length"] + 1)[0] for s in seqs],
            device=self.device,
        )  # fmt: skip
        t = lambda x: torch.tensor(x, dtype=torch.int64, device=self.device)  # noqa: E731
        return StepInputs(t([s["ids"][s["length"]] for s in seqs]), t([s["length"] for s in seqs]), meta,
                          t(list(range(len(seqs)))))  # fmt: skip

    @torch.inference_mode()
    def eager_logits(self, inputs) -> torch.Tensor:
        hidden = self.model(inputs.input_ids, inputs.positions, inputs.meta, self.pool.kv_caches)
        return self.model.compute_logits(hidden)

    def graphs(self, max_batch_size=16, max_total_tokens=MAX_TOTAL) -> DecodeGraphs:
        return DecodeGraphs(self.model, self.pool.kv_caches, max_batch_size=max_batch_size,
                            max_total_tokens=max_total_tokens, block_size=BLOCK, vocab_size=self.config.vocab_size,
                            device=self.device)  # fmt: skip


def test_static_buffers_give_the_normal_logits(model_dir):
    s = Setup(model_dir)
    for length in (1, 3, 4, 9, 17, 30, 42, 5, 12, 21, 2):  # mixed contexts, ragged last blocks
        s.add(length)
    graphs = s.graphs()
    # Widest first, so later (narrower) steps find stale rows and table entries in the buffers.
    for batch in (11, 3, 5, 1, 7, 6):
        seqs = s.seqs[:batch] if batch != 6 else s.seqs[5:]
        inputs = s.decode_inputs(seqs)
        before = s.pool.storage.clone()
        ref = s.eager_logits(inputs)
        expected_pool = s.pool.storage.clone()
        s.pool.storage.copy_(before)  # undo the reference's KV writes; the graph path writes the same ones
        with torch.inference_mode():
            got = graphs.logits_for(inputs)
        assert got.shape == ref.shape == (batch, s.config.vocab_size)
        diff = (got - ref).abs().max().item()
        assert diff <= 1e-5 * ref.abs().max().item(), (batch, diff)
        assert torch.equal(got.argmax(-1), ref.argmax(-1))
        # Padding rows wrote only into scratch block 0: blocks outside the step's tables are
        # untouched, and the real rows wrote what the eager step wrote (to float rounding: later
        # layers' K/V depend on GEMMs over 16 rather than 11 rows).
        others = sorted(set(range(1, 120)) - {b for q in seqs for b in q["table"]})
        assert torch.equal(s.pool.storage[:, :, others], before[:, :, others])
        torch.testing.assert_close(s.pool.storage[:, :, 1:], expected_pool[:, :, 1:], rtol=1e-5, atol=1e-5)
        print(f"batch {batch} (bucket {select_bucket(graphs.sizes, batch)}): max |diff| {diff:.2e}")


def test_steps_that_do_not_fit_run_eagerly(model_dir):
    s = Setup(model_dir)
    for length in (3,) * 5:
        s.add(length)
    graphs = s.graphs(max_batch_size=4)
    assert graphs.logits_for(s.decode_inputs(s.seqs)) is None  # 5 rows > the largest bucket
    wide = s.decode_inputs(s.seqs[:1])
    wide.meta.block_tables = torch.zeros(1, MAX_TOTAL // BLOCK + 1, dtype=torch.int32)
    assert graphs.logits_for(wide) is None  # a table wider than max_total_tokens allows


def test_runner_decodes_the_same_tokens_through_the_static_buffers(model_dir):
    """The engine hook: greedy generation with DecodeGraphs forced on (eager on CPU) == without."""
    from test_speculative import generate

    def runner():
        model, config = load_model(model_dir)
        r = ModelRunner(model, config, block_size=BLOCK, kv_cache_memory=400 * 2 * 2 * 2 * 16 * BLOCK * 4)
        r.warmup(pb.WarmupRequest(max_batch_prefill_tokens=64, max_input_tokens=32, max_total_tokens=96,
                                  max_batch_size=8))  # fmt: skip
        assert r.cuda_graphs is None  # CPU: never captured
        return r

    prompts = [[5, 17, 99, 42, 7, 250, 3], [60, 61], [1, 200, 13, 14, 15], [9] * 11, [33, 34, 35]]
    ref = generate(runner(), prompts, 20)
    r = runner()
    r.cuda_graphs = DecodeGraphs(r.model, r.pool.kv_caches, max_batch_size=8, max_total_tokens=96, block_size=BLOCK,
                                 vocab_size=r.config.vocab_size, device="cpu")  # fmt: skip
    calls = []
    original = r.cuda_graphs.forward
    r.cuda_graphs.forward = lambda bucket: (calls.append(bucket), original(bucket))[1]
    got = generate(r, prompts, 20)
    assert [got[i].ids for i in range(5)] == [ref[i].ids for i in range(5)]
    assert calls and set(calls) == {8}  # 5 sequences decode on the 8-row bucket


def test_cpu_ignores_the_flag(model_dir):
    model, config = load_model(model_dir)
    assert not ModelRunner(model, config, cuda_graphs=True).use_cuda_graphs


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: captures and replays CUDA graphs")
@pytest.mark.parametrize("backend", ["triton", "torch", "flash"])
def test_capture_and_replay_match_eager(model_dir, backend):
    if backend == "flash":
        pytest.importorskip("flash_attn")
    s = Setup(model_dir, device="cuda", backend=backend, dtype=torch.bfloat16)
    for length in (1, 3, 9, 17, 30, 42, 5, 12, 21, 2, 50):
        s.add(length)
    graphs = s.graphs()
    graphs.capture()
    assert sorted(graphs.graphs) == graphs.sizes == [1, 2, 4, 8, 16]
    for batch in (11, 3, 1, 7):
        inputs = s.decode_inputs(s.seqs[:batch])
        before = s.pool.storage.clone()
        ref = s.eager_logits(inputs)
        expected_pool = s.pool.storage.clone()
        s.pool.storage.copy_(before)
        with torch.inference_mode():
            got = graphs.logits_for(inputs).clone()
        torch.cuda.synchronize()
        # bf16: the eager and the padded graph step may pick different kernels (batch-size dependent GEMM
        # tiles), so logits agree to bf16 rounding, not bit for bit.
        err = ((got - ref).abs().max() / ref.abs().max()).item()
        assert err < 2e-2, (backend, batch, err)
        # Blocks outside the step's tables (scratch aside) are untouched: padding rows wrote only to block 0.
        others = sorted(set(range(1, 120)) - {b for q in s.seqs[:batch] for b in q["table"]})
        assert torch.equal(s.pool.storage[:, :, others], before[:, :, others])
        del expected_pool
        print(f"{backend} batch {batch}: graph vs eager rel err {err:.2e}")


def test_flags_reach_shard_config():
    from pagemill.cli import build_parser, shard_config

    def cfg(*flags):
        a = build_parser().parse_args(["shard", "--model-dir", "m", "--uds-path", "s", *flags])
        return shard_config(a, a.model_dir, a.uds_path, a.rank, a.world_size)

    assert cfg().cuda_graphs is True and cfg().kv_cache_dtype == "auto"
    off = cfg("--no-cuda-graphs", "--kv-cache-dtype", "fp8_e5m2")
    assert off.cuda_graphs is False and off.kv_cache_dtype == "fp8_e5m2"
    assert cfg("--cuda-graphs").cuda_graphs is True  # the spelling the launcher passes
    launch = build_parser().parse_args(["launch", "--no-cuda-graphs", "--kv-cache-dtype", "fp8_e4m3"])
    assert launch.cuda_graphs is False and launch.kv_cache_dtype == "fp8_e4m3"
