"""shard/threads.py: the thread-count chooser of small CPU decode steps, and that the
tokens a runner produces do not depend on it."""

from __future__ import annotations

import pytest
import torch

from conftest import build_model_dir
from pagemill.cpu_kernels.decode import decode_kernels
from pagemill.models.fused_decode import FUSED_MAX_SMALL_BATCH
from pagemill.models.loader import load_model
from pagemill.proto import pb
from pagemill.shard.model_runner import ModelRunner
from pagemill.bench.block_router import BlockRouter
from pagemill.shard.threads import EXPLORE_EVERY, EXPLORE_MAX, LOAD_CHANGE, ThreadChoice, choose, thread_counts


def test_untried_counts_come_first_in_order():
    assert choose((2, 1), {}, 0) == 2
    assert choose((2, 1), {2: 5.0}, 1) == 1


def test_faster_estimate_wins_and_the_other_is_tried_after_explore_steps():
    est = {2: 30.0, 1: 10.0}
    picks = [choose((2, 1), est, s) for s in range(EXPLORE_EVERY)]
    assert picks[:-1] == [1] * (EXPLORE_EVERY - 1) and picks[-1] == 2


def simulate(c: ThreadChoice, steps: int, ns: dict[int, int]) -> list[int]:
    """The counts picked over `steps` steps whose times are ns[count]."""
    picks = []
    for _ in range(steps):
        picks.append(c.pick())
        c.record(picks[-1], ns[picks[-1]])
    return picks


def test_tries_that_lose_come_ever_more_rarely():
    c = ThreadChoice((2, 1))
    picks = simulate(c, 6000, {2: 10_500_000, 1: 19_000_000})  # an idle machine: two threads win
    tries = picks.count(1) - 1  # the first step of one thread is its first measurement
    # Every 64th step would be 93 tries; doubling to EXPLORE_MAX: 64, 128, ..., 1024, 1024, ...
    assert 6 <= tries <= 9 and c.every == EXPLORE_MAX
    gaps = [b - a for a, b in zip([i for i, p in enumerate(picks) if p == 1][1:], [i for i, p in enumerate(picks) if p == 1][2:])]
    assert gaps == sorted(gaps) and gaps[0] == 2 * EXPLORE_EVERY and gaps[-1] == EXPLORE_MAX


def test_a_load_change_brings_the_next_try_at_once():
    c = ThreadChoice((2, 1))
    simulate(c, 3000, {2: 10, 1: 19})
    assert c.every == EXPLORE_MAX
    picks = simulate(c, 10, {2: 200, 1: 19})  # other processes take the cores: two threads stall
    assert 1 in picks[:5]  # not 1024 steps later
    assert c.pick() == 1 and c.every == EXPLORE_EVERY  # one thread now, the other tried every 64 again
    picks = simulate(c, EXPLORE_EVERY + 1, {2: 10, 1: 19})  # the load went away
    assert picks[-1] == 2 and c.pick() == 2  # within one interval, back to two threads
    assert LOAD_CHANGE > 1


def test_a_slow_drift_of_the_count_in_use_has_the_other_tried():
    c = ThreadChoice((2, 1))
    simulate(c, 3000, {2: 10, 1: 30})
    picks = simulate(c, 40, {2: 14, 1: 30})  # 1.4x slower, still the faster: tried once, then backed off
    assert picks.count(1) == 1 and c.every == EXPLORE_MAX


def test_estimates_follow_the_load():
    c = ThreadChoice((2, 1))
    c.record(2, 10)
    c.record(1, 20)
    assert c.pick() == 2
    for _ in range(10):  # two threads become slow (shared cores)
        c.record(2, 200)
    assert c.estimate[2] > c.estimate[1] and c.pick() == 1


def test_a_try_of_the_count_not_in_use_replaces_its_estimate():
    c = ThreadChoice((2, 1))
    c.record(2, 500)  # two threads were slow (shared cores): one is in use
    c.record(1, 50)
    c.record(1, 50)
    c.record(2, 20)  # the load went away: one try is enough to switch back
    assert c.estimate[2] == 20 and c.pick() == 2


def test_one_configured_thread_has_nothing_to_compare():
    assert thread_counts(1) == (1,)
    assert thread_counts(4) == (4, 1)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_model_dir(str(tmp_path_factory.mktemp("adaptive")), "llama_gqa")


def run(model_dir: str, adaptive: bool):
    model, config = load_model(model_dir, cpu_kernels=True)
    if model.model.fused is None:
        pytest.skip("no compiled CPU kernels here")
    runner = ModelRunner(model, config, block_size=16, kv_cache_memory=1 << 24, model_dir=model_dir,
                         cpu_kernels=True, adaptive_threads=adaptive)  # fmt: skip
    runner.warmup(pb.WarmupRequest(max_batch_prefill_tokens=64, max_input_tokens=32, max_total_tokens=64,
                                   max_batch_size=4))  # fmt: skip
    router = BlockRouter.for_runner(runner)
    for rid, prompt in enumerate([[5, 17, 99, 42, 7], [60, 61], [1, 200, 13, 14]]):
        router.add(rid, prompt, 12, ignore_eos=True)
    return router.run(), runner


def test_tokens_do_not_depend_on_the_chosen_count(model_dir):
    if decode_kernels() is None:
        pytest.skip("no compiled CPU kernels here")
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        ref, _ = run(model_dir, adaptive=False)
        out, runner = run(model_dir, adaptive=True)
        assert torch.get_num_threads() == 2  # restored after every step
    finally:
        torch.set_num_threads(before)
    assert set(runner.thread_choices[3].estimate) == {2, 1}  # both counts ran the 3-sequence decode steps
    for rid, r in ref.items():
        assert out[rid].ids == r.ids
        assert out[rid].logprobs == r.logprobs  # bit for bit: each row is one thread's work


def test_large_int8_fused_steps_keep_all_threads(model_dir):
    """The int8 fused layer takes up to 256 sequences, but only its small steps go to the
    chooser: a 12-sequence step runs on every thread, untried on one."""
    if decode_kernels() is None:
        pytest.skip("no compiled CPU kernels here")
    model, config = load_model(model_dir, cpu_kernels=True, quantize="int8")
    fused = model.model.fused
    if fused is None or not fused.int8:
        pytest.skip("no int8 fused layer here")
    assert fused.max_batch >= 12 and fused.max_small_batch == FUSED_MAX_SMALL_BATCH
    runner = ModelRunner(model, config, block_size=16, kv_cache_memory=1 << 24, model_dir=model_dir,
                         cpu_kernels=True, adaptive_threads=True)  # fmt: skip
    runner.warmup(pb.WarmupRequest(max_batch_prefill_tokens=256, max_input_tokens=32, max_total_tokens=64,
                                   max_batch_size=12))  # fmt: skip
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        router = BlockRouter.for_runner(runner)
        for rid in range(12):
            router.add(rid, [5 + rid, 17, 99], 6, ignore_eos=True)
        out = router.run()
    finally:
        torch.set_num_threads(before)
    assert all(len(o.ids) == 6 for o in out.values())
    assert 12 not in runner.thread_choices and set(runner.thread_choices) <= set(range(1, FUSED_MAX_SMALL_BATCH + 1))
