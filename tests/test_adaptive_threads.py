"""shard/threads.py: the thread-count chooser of small CPU decode steps, and that the
tokens a runner produces do not depend on it."""

from __future__ import annotations

import pytest
import torch

from conftest import build_model_dir
from pagemill.cpu_kernels import decode_kernels
from pagemill.models.loader import load_model
from pagemill.proto import pb
from pagemill.shard.engine import ModelRunner
from pagemill.shard.harness import FakeRouter
from pagemill.shard.threads import EXPLORE_EVERY, ThreadChoice, choose, thread_counts


def test_untried_counts_come_first_in_order():
    assert choose((2, 1), {}, 0) == 2
    assert choose((2, 1), {2: 5.0}, 1) == 1


def test_faster_estimate_wins_and_the_other_is_tried_every_explore_steps():
    est = {2: 30.0, 1: 10.0}
    picks = [choose((2, 1), est, s) for s in range(2 * EXPLORE_EVERY)]
    assert picks.count(2) == 2 and picks.count(1) == 2 * EXPLORE_EVERY - 2
    assert picks[EXPLORE_EVERY - 1] == 2 and picks[2 * EXPLORE_EVERY - 1] == 2


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
    router = FakeRouter.for_runner(runner)
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
