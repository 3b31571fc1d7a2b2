"""ShardService's step queue, in process: the model thread drains queued steps and answers
each on its own call's event loop."""

from __future__ import annotations

import asyncio
import time

from conftest import build_model_dir
from pagemill.bench.block_router import BlockRouter
from pagemill.shard.service import ShardService
from test_speculative import make_runner


def test_a_step_queued_from_another_event_loop_is_answered_there(tmp_path):
    """A drain submitted by one call may pick up a step that a later call queued from another
    event loop (a caller running each call in its own loop, as test_grammar's service test
    does). That answer must go to the later call's loop: sent to the first call's loop, closed
    by then, it was lost and the later call waited forever (a unit run hung on it once)."""
    runner = make_runner(build_model_dir(str(tmp_path), "llama_gqa"))
    service = ShardService(runner)
    next_step, calls, picked = service._next_step, [], []

    def next_step_once_the_second_is_queued():
        # The first drain's second look, after answering the first step: hold it until
        # the second call has queued its step, as a slow thread switch would.
        calls.append(1)
        if len(calls) == 2:
            deadline = time.monotonic() + 10
            while not service._steps and time.monotonic() < deadline:
                time.sleep(0.005)
            entry = next_step()
            picked.append(entry is not None)
            return entry
        return next_step()

    service._next_step = next_step_once_the_second_is_queued
    router = BlockRouter(lambda req: asyncio.run(asyncio.wait_for(service.Step(req, None), 20)),
                        runner.pool.num_blocks, runner.block_size)  # fmt: skip
    router.add(1, [5, 6, 7], 4, ignore_eos=True)
    first = router.step()
    second = router.step()  # TimeoutError here when its answer went to the first loop
    assert [g.request_id for g in first.generations] == [g.request_id for g in second.generations] == [1]
    assert picked == [True], "the first drain did not pick up the second step: the case is not exercised"
    assert len(router.requests[1].out.ids) == 2
