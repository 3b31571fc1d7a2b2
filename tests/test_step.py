"""ModelRunner.step semantics, in process: chunked prompts, prompt chunks and decode tokens
in one step, finished_ids, per-request errors, preemption and resumption.

Every comparison is against the same requests run one at a time, unchunked
(and, for greedy tokens, against transformers via test_shard_service.hf_greedy).
"""

from __future__ import annotations

import math

import pytest
import torch

from conftest import build_model_dir, load_hf
from pagemill.proto import pb
from pagemill.shard.errors import ShardError
from pagemill.bench.block_router import BlockRouter
from test_shard_service import hf_greedy
from test_speculative import make_runner

PROMPTS = {
    1: [5, 17, 99, 42, 7, 250, 3],
    2: [60, 61],
    3: [1, 200, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23],
    4: [9] * 11,
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_model_dir(str(tmp_path_factory.mktemp("step")), "llama_gqa")


@pytest.fixture(scope="module")
def alone(model_dir):
    """Each request run by itself, whole prompt in one step: {rid: Output}."""
    out = {}
    for rid, prompt in PROMPTS.items():
        router = BlockRouter.for_runner(make_runner(model_dir))
        router.add(rid, prompt, 10, ignore_eos=True, top_n=4)
        out[rid] = router.run()[rid]
    return out


def assert_same(out, ref) -> None:
    assert out.ids == ref.ids and out.top == ref.top and out.finish == ref.finish
    torch.testing.assert_close(out.logprobs, ref.logprobs, atol=1e-5, rtol=1e-5)


def test_reference_is_transformers_greedy(model_dir, alone):
    hf = load_hf(model_dir)
    for rid, prompt in PROMPTS.items():
        assert alone[rid].ids == hf_greedy(hf, prompt, 10), rid


def test_mixed_steps_equal_separate_steps(model_dir, alone):
    """Requests 3 and 4 join while 1 and 2 decode; their prompts go in chunks of 3 and 5,
    each chunk in the same Step as the others' decode tokens."""
    runner = make_runner(model_dir)
    router = BlockRouter.for_runner(runner)
    for rid in (1, 2):
        router.add(rid, PROMPTS[rid], 10, ignore_eos=True, top_n=4)
    router.step()
    router.step()
    router.add(3, PROMPTS[3], 10, ignore_eos=True, top_n=4, chunk=3)
    router.add(4, PROMPTS[4], 10, ignore_eos=True, top_n=4, chunk=5)
    mixed = 0
    while router.requests:
        req = router.plan()
        kinds = {e.num_computed + e.num_tokens < len(router.requests[e.id].tokens) for e in req.requests}
        mixed += kinds == {True, False}  # an intermediate chunk next to sampled entries
        resp = router.send(req)
        for e, g in zip(req.requests, resp.generations):
            if e.id in runner.requests and not g.tokens.ids:  # a chunk: computed, not sampled
                assert runner.requests[e.id].computed == e.num_computed + e.num_tokens
    assert mixed >= 3
    for rid in PROMPTS:
        assert_same(router.outputs[rid], alone[rid])


def test_chunked_prompt_equals_unchunked(model_dir, alone):
    for chunk in (1, 4, 12):
        router = BlockRouter.for_runner(make_runner(model_dir))
        router.add(3, PROMPTS[3], 10, ignore_eos=True, top_n=4, chunk=chunk)
        steps = 0
        while not router.outputs[3].ids:
            gens = router.step().generations
            assert len(gens) == 1 and (gens[0].tokens.ids or not gens[0].HasField("tokens"))
            steps += 1
        assert steps == -(-len(PROMPTS[3]) // chunk)
        assert_same(router.run()[3], alone[3])


def test_prompt_logprobs_cross_chunk_boundaries(model_dir):
    """Each chunk reports the positions its rows predict, its end included (the next chunk's
    first token): pieced together, every position past the first equals transformers', with
    ranks and alternatives from the same log_softmax."""
    prompt = PROMPTS[3]
    with torch.no_grad():
        ref = load_hf(model_dir)(torch.tensor([prompt])).logits[0].float().log_softmax(-1)
    want = [ref[i - 1, prompt[i]].item() for i in range(1, len(prompt))]
    for chunk in (1, 4, 5, None):
        router = BlockRouter.for_runner(make_runner(model_dir))
        out = router.add(3, prompt, 2, ignore_eos=True, prefill_logprobs=True, prompt_top_n=3, chunk=chunk)
        router.run()
        assert math.isnan(out.prompt[0]) and out.prompt[1:] == pytest.approx(want, abs=1e-4), chunk
        for pos in range(1, len(prompt)):
            top = ref[pos - 1].topk(3).indices.tolist()
            assert out.prompt_top[pos] == top, (chunk, pos)
            assert out.prompt_ranks[pos] == int((ref[pos - 1] > ref[pos - 1, prompt[pos]]).sum()) + 1


def test_finished_ids_drop_state(model_dir, alone):
    runner = make_runner(model_dir)
    router = BlockRouter.for_runner(runner)
    for rid in (1, 2, 3):
        router.add(rid, PROMPTS[rid], 10, ignore_eos=True, top_n=4)
    router.step()
    router.abort(2)
    assert set(runner.requests) == {1, 2, 3}
    req = router.plan()
    req.finished_ids.append(12345)  # unknown: ignored
    assert list(req.finished_ids) == [2, 12345] and [e.id for e in req.requests] == [1, 3]
    router.send(req)
    assert set(runner.requests) == {1, 3}
    out = router.run()
    assert not runner.requests  # finished requests are dropped too
    assert_same(out[1], alone[1]) and assert_same(out[3], alone[3])
    assert out[2].ids == alone[2].ids[:1]


def test_contradicting_entries_fail_alone(model_dir, alone):
    """An unknown id and a num_computed mismatch: that entry gets an error, is not computed,
    its state is dropped; the other requests proceed as if it were not there."""
    runner = make_runner(model_dir)
    router = BlockRouter.for_runner(runner)
    for rid in (1, 2, 3):
        router.add(rid, PROMPTS[rid], 10, ignore_eos=True, top_n=4)
    router.step()
    req = router.plan()
    req.requests[1].num_computed += 1  # request 2
    req.requests.append(pb.ScheduledRequest(id=77, num_computed=3, num_tokens=1, new_block_ids=[router.blocks.free[0]]))
    gens = router.send(req).generations
    assert [g.request_id for g in gens] == [1, 2, 3, 77]
    assert "num_computed" in gens[1].error and "unknown" in gens[3].error
    assert not gens[1].tokens.ids and not gens[3].tokens.ids and gens[0].tokens.ids and gens[2].tokens.ids
    assert set(runner.requests) == {1, 3} and router.outputs[2].done
    out = router.run()
    assert_same(out[1], alone[1]) and assert_same(out[3], alone[3])


def test_rejected_step_changes_nothing(model_dir, alone):
    runner = make_runner(model_dir)
    router = BlockRouter.for_runner(runner)
    for rid in (1, 2):
        router.add(rid, PROMPTS[rid], 10, ignore_eos=True, top_n=4)
    router.step()
    router.add(3, PROMPTS[3], 10, ignore_eos=True, top_n=4)
    req = router.plan()
    req.finished_ids.append(1)
    req.requests[2].new_block_ids.append(0)  # garbage in request 3's entry
    before = {rid: (list(r.token_ids), r.computed, list(r.block_table)) for rid, r in runner.requests.items()}
    with pytest.raises(ShardError, match="block id 0"):
        router.send(req)
    assert {rid: (list(r.token_ids), r.computed, list(r.block_table)) for rid, r in runner.requests.items()} == before
    out = router.run()
    for rid in (1, 2, 3):
        assert_same(out[rid], alone[rid])


@pytest.mark.parametrize("penalties", [False, True])
def test_preempted_request_resumes(model_dir, penalties):
    """Preempted after 4 tokens, resent with its generated tokens (generated_len): the same
    tokens as an uninterrupted run. Frequency/presence penalties count generated tokens only,
    so they check that generated_len is honoured."""
    params = pb.NextTokenChooserParameters(repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.4) \
        if penalties else None

    def run(preempt_at: int | None):
        runner = make_runner(model_dir)
        router = BlockRouter.for_runner(runner)
        router.add(1, PROMPTS[1], 10, ignore_eos=True, params=params)
        router.add(2, PROMPTS[4], 10, ignore_eos=True, params=params, min_new_tokens=8)
        for _ in range(preempt_at or 0):
            router.step()
        if preempt_at:
            router.preempt(1)
            router.preempt(2)
            req = router.plan()
            assert [e.new_request.generated_len for e in req.requests] == [preempt_at] * 2
            assert [e.new_request.stopping_parameters.min_new_tokens for e in req.requests] == [0, 8 - preempt_at]
            assert list(req.finished_ids) == [1, 2]
            router.send(req)
        return router.run()

    ref, resumed = run(None), run(4)
    for rid in (1, 2):
        assert resumed[rid].ids == ref[rid].ids and resumed[rid].finish == ref[rid].finish
        torch.testing.assert_close(resumed[rid].logprobs, ref[rid].logprobs, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("draft", [False, True], ids=["ngram", "draft"])
def test_speculation_with_chunked_late_joiners(model_dir, alone, draft):
    """Proposals only in steps without prompt chunks; the draft's pool follows the chunks
    (with the target as its own draft every proposal is accepted once the prompt is in)."""
    runner = make_runner(model_dir, speculate=3, draft_dir=model_dir if draft else None)
    router = BlockRouter.for_runner(runner)
    router.add(4, PROMPTS[4], 10, ignore_eos=True, top_n=4)  # repetitive: n-gram proposals hit
    router.step()
    router.add(3, PROMPTS[3], 10, ignore_eos=True, top_n=4, chunk=5)
    router.add(1, PROMPTS[1], 10, ignore_eos=True, top_n=4, chunk=4)
    multi = []
    while router.requests:
        req = router.plan()
        gens = router.send(req).generations
        if any(e.num_tokens > 1 for e in req.requests):
            assert all(len(g.tokens.ids) <= 1 for g in gens)  # no proposals next to prompt chunks
        elif draft:
            multi += [len(g.tokens.ids) for g in gens if not g.finish_reason]
    for rid in (1, 3, 4):
        assert_same(router.outputs[rid], alone[rid])
    if draft:
        assert multi and all(n == 4 for n in multi)


def test_prompt_logprobs_of_a_cached_prompt_in_a_speculative_step(model_dir):
    """A request whose prompt is cached but for its last token is a decode entry: its first
    step verifies proposals (the target as its own draft: all accepted, the draft pool's
    copy of the shared blocks included) and reports its prompt logprobs (NaN: cached)."""
    hf = load_hf(model_dir)
    runner = make_runner(model_dir, speculate=3, draft_dir=model_dir)
    router = BlockRouter.for_runner(runner)
    router.add(4, PROMPTS[4][:8] + [7, 7, 7], 10, ignore_eos=True)
    router.step()
    other = PROMPTS[4][:8] + [42]
    router.add(5, other, 6, ignore_eos=True, prefix=(4, 8), prefill_logprobs=True)
    req = router.plan()
    assert [(e.num_tokens, e.max_proposals) for e in req.requests] == [(1, 3), (1, 3)]
    gens = router.send(req).generations
    # Its one computed token is the last: no prompt position to predict (the router holds the rest).
    assert len(gens[1].tokens.ids) == 4 and not gens[1].HasField("prompt_logprobs")
    assert router.run()[5].ids == hf_greedy(hf, other, 6)
