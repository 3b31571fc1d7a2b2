"""What a decode step does around the model, made cheaper, against the reference behaviour:

- bfloat16 logits reach the sampler unwidened (head_logits): the tokens, logprobs and
  top-n alternatives equal those sampled from the float32 logits (compute_logits), for
  the compiled greedy pass and for the torch path (warpers, seeds, penalties, min tokens);
- step inputs and attention metadata are views of one tensor per dtype: their values,
  dtypes and shapes are those of the per-field construction;
- the KV pool's per-layer views are made once per storage tensor;
- check_step skips the distinct-blocks check only where no block is new.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from pagemill.attention.metadata import make_metadata
from pagemill.cpu_kernels.rowwise import greedy_kernel
from pagemill.models.loader import load_model
from pagemill.proto import pb
from pagemill.sampling import Sampler, SamplingParams
from pagemill.shard.model_runner import ModelRunner
from pagemill.shard.errors import ShardError
from pagemill.bench.block_router import BlockRouter
from pagemill.shard.kv_pool import KVPool
from pagemill.shard.requests import Entry, Limits, check_step
from pagemill.shard.step_inputs import build_inputs, slot

BLOCK = 4


# --- sampling from bfloat16 logits ----------------------------------------------------------

PARAMS = {
    "greedy": dict(params=pb.NextTokenChooserParameters()),
    "greedy_top_n": dict(params=pb.NextTokenChooserParameters(), top_n=3),
    "sampled": dict(params=pb.NextTokenChooserParameters(temperature=0.7, top_k=20, top_p=0.9, do_sample=True,
                                                         seed=11, has_seed=True)),
    "penalties": dict(params=pb.NextTokenChooserParameters(repetition_penalty=1.3, frequency_penalty=0.4)),
    "min_tokens": dict(params=pb.NextTokenChooserParameters(), min_new_tokens=5, stop_token_ids=[7]),
}


def bf16_runner(model_dir: str, compiled_greedy: bool) -> ModelRunner:
    model, config = load_model(model_dir, torch.bfloat16)
    runner = ModelRunner(model, config, block_size=BLOCK, kv_cache_memory=8 << 20, model_dir=model_dir)
    runner.warmup(pb.WarmupRequest(max_batch_prefill_tokens=64, max_input_tokens=32, max_total_tokens=64,
                                   max_batch_size=4))  # fmt: skip
    runner.sampler = Sampler(seed=3, greedy=greedy_kernel() if compiled_greedy else None)
    return runner


def run(runner: ModelRunner, widen: bool):
    if widen:  # the reference: float32 logits into the sampler, as before head_logits
        head = runner.model.head_logits
        runner.model.head_logits = lambda hidden: head(hidden).float()
    router = BlockRouter.for_runner(runner)
    outs = [router.add(i, [3 + 5 * i + t for t in range(6 + i)], 8, ignore_eos=True, **kw)
            for i, kw in enumerate(PARAMS.values())]
    while router.requests:
        router.step()
    return [(o.ids, o.logprobs, o.top) for o in outs]


@pytest.mark.parametrize("compiled_greedy", [True, False], ids=["greedy-kernel", "torch"])
def test_bf16_logits_sample_as_float32(llama_dir, compiled_greedy):
    got = run(bf16_runner(llama_dir, compiled_greedy), widen=False)
    ref = run(bf16_runner(llama_dir, compiled_greedy), widen=True)
    assert got == ref
    assert all(len(ids) == 8 for ids, _, _ in got)


def test_head_logits_is_compute_logits_unwidened(llama_dir):
    model, _ = load_model(llama_dir, torch.bfloat16)
    hidden = torch.randn(3, model.config.hidden_size).to(torch.bfloat16)
    raw = model.head_logits(hidden)
    assert raw.dtype == torch.bfloat16
    assert torch.equal(raw.float(), model.compute_logits(hidden))


@pytest.mark.skipif(greedy_kernel() is None, reason="no C++ compiler / not x86-64 Linux")
def test_sampler_greedy_kernel_reads_bf16_rows():
    logits = (torch.randn(5, 1000, generator=torch.Generator().manual_seed(0)) * 4).to(torch.bfloat16)
    rows = [SimpleNamespace(params=SamplingParams(), top_n=0, generator=None, penalties=None)] * 5
    fast = Sampler(seed=0, greedy=greedy_kernel())(logits, rows)
    ref = Sampler(seed=0)(logits.float(), rows)
    assert fast.token_ids == ref.token_ids and fast.logprobs == pytest.approx(ref.logprobs, abs=1e-5)


# --- step inputs and metadata -----------------------------------------------------------------


def test_metadata_fields():
    meta = make_metadata(is_prefill=True, query_lens=[3, 1], kv_lens=[5, 9], block_tables=[[4, 2], [7, 8, 9]],
                         slot_mapping=[18, 19, 8, 36], device="cpu")  # fmt: skip
    expect = {"cu_seqlens_q": [0, 3, 4], "cu_seqlens_k": [0, 5, 14], "context_lens": [5, 9],
              "block_tables": [[4, 2, 0], [7, 8, 9]]}  # fmt: skip
    for name, values in expect.items():
        t = getattr(meta, name)
        assert t.dtype == torch.int32 and t.is_contiguous() and t.tolist() == values, name
    assert meta.slot_mapping.dtype == torch.int64 and meta.slot_mapping.tolist() == [18, 19, 8, 36]
    assert (meta.max_seqlen_q, meta.max_seqlen_k, meta.query_lens, meta.kv_lens) == (3, 9, [3, 1], [5, 9])
    empty = make_metadata(is_prefill=False, query_lens=[], kv_lens=[], block_tables=[], slot_mapping=[], device="cpu")
    assert empty.block_tables.shape == (0, 0) and empty.cu_seqlens_q.tolist() == [0]


def entry(tokens: list[int], start: int, n: int, table: list[int], proposals=()) -> Entry:
    state = SimpleNamespace(token_ids=tokens, block_table=table, seq_len=len(tokens), adapter=None)
    return Entry(0, state, start, n, 0, [], False, proposals=list(proposals))


@pytest.mark.parametrize("kind", ["decode", "mixed", "proposals"])
def test_build_inputs(kind):
    entries = {
        "decode": [entry([5, 6, 7, 8, 9], 4, 1, [3, 6]), entry([1, 2], 1, 1, [9])],
        "mixed": [entry([5, 6, 7, 8, 9], 4, 1, [3, 6]), entry(list(range(10, 19)), 2, 7, [1, 4, 2])],
        "proposals": [entry([5, 6, 7, 8, 9], 4, 1, [3, 6], proposals=[40, 41])],
    }[kind]
    got = build_inputs(entries, BLOCK, "cpu")
    ids, positions, slots, last = [], [], [], []
    for e in entries:  # the reference: per entry, what step_inputs' docstring says
        fed = e.state.token_ids[e.start : e.end] + e.proposals
        ids += fed
        positions += list(range(e.start, e.start + len(fed)))
        slots += [slot(e.state.block_table, p, BLOCK) for p in range(e.start, e.start + len(fed))]
        last.append(len(ids) - 1)
    assert got.input_ids.tolist() == ids and got.positions.tolist() == positions
    assert got.last_rows.tolist() == last and got.meta.slot_mapping.tolist() == slots
    assert got.input_ids.dtype == got.positions.dtype == got.last_rows.dtype == torch.int64
    assert got.meta.is_prefill == (kind != "decode")
    lens = [len(e.state.token_ids[e.start : e.end] + e.proposals) for e in entries]
    assert got.meta.query_lens == lens and got.meta.kv_lens == [e.start + q for e, q in zip(entries, lens)]
    assert got.lora is None  # no adapter rows: every linear as without adapters


def test_kv_caches_made_once_per_storage(llama_dir):
    _, config = load_model(llama_dir)
    pool = KVPool.with_blocks(config, num_blocks=4, block_size=BLOCK, dtype=torch.float32, device="cpu")
    views = pool.kv_caches
    assert pool.kv_caches is views and len(views) == config.num_hidden_layers
    for layer, (k, v) in enumerate(views):
        assert k.data_ptr() == pool.storage[layer, 0].data_ptr() and v.data_ptr() == pool.storage[layer, 1].data_ptr()
    pool.storage = torch.zeros_like(pool.storage)
    assert pool.kv_caches[0][0].data_ptr() == pool.storage[0, 0].data_ptr()


# --- check_step's distinct-blocks check -------------------------------------------------------


def held_request():
    return SimpleNamespace(block_table=[3, 4], computed=6, seq_len=7)


def step(new_blocks: list[int], num_computed: int = 6):
    return pb.StepRequest(requests=[pb.ScheduledRequest(id=1, num_computed=num_computed, num_tokens=1,
                                                        new_block_ids=new_blocks)])  # fmt: skip


def test_held_table_without_new_blocks_is_accepted():
    entries = check_step(step([]), {1: held_request()}, Limits(BLOCK, 16, 100, torch.device("cpu")))
    assert entries[0].state is not None and entries[0].new_blocks == []


@pytest.mark.parametrize("new", [[3], [5, 5]], ids=["repeats-held", "repeats-new"])
def test_new_block_repeating_one_is_rejected(new):
    with pytest.raises(ShardError, match="repeats a block id"):
        check_step(step(new), {1: held_request()}, Limits(BLOCK, 16, 100, torch.device("cpu")))
