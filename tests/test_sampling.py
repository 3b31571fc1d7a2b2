"""Sampler controls against transformers' logits processors; seeding; greedy."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch
from transformers import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    TypicalLogitsWarper,
)

from pagemill.proto import pb
from pagemill.sampling import PenaltyState, Sampler, SamplingParams, apply_penalties, apply_warpers

VOCAB = 200


@dataclass
class Row:
    params: SamplingParams
    token_ids: list[int] = field(default_factory=lambda: [0])
    prompt_len: int = 1
    top_n: int = 0
    generator: torch.Generator | None = None
    penalties: PenaltyState | None = None

    def __post_init__(self) -> None:
        if self.params.has_penalties:
            self.penalties = PenaltyState.from_tokens(self.token_ids, self.prompt_len, VOCAB, "cpu")

    def seeded(self) -> "Row":
        if self.params.seed is not None:
            self.generator = torch.Generator().manual_seed(self.params.seed)
        return self


def random_logits(rows: int, seed: int = 0, vocab: int = VOCAB) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=g) * 3
    logits[:, :5] = logits[:, 5:10]  # ties
    return logits


def hf_warp(logits_row: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """HF's warper chain for one row, in generate()'s order."""
    x = logits_row[None].clone()
    ids = torch.zeros((1, 1), dtype=torch.long)
    if p.temperature not in (0.0, 1.0):
        x = TemperatureLogitsWarper(p.temperature)(ids, x)
    if p.top_k > 0:
        x = TopKLogitsWarper(p.top_k)(ids, x)
    if p.top_p < 1.0:
        x = TopPLogitsWarper(p.top_p)(ids, x)
    if p.min_p > 0.0:
        x = MinPLogitsWarper(p.min_p)(ids, x)
    if p.typical_p < 1.0:
        x = TypicalLogitsWarper(p.typical_p)(ids, x)
    return x[0]


def ours_warp(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    temps = torch.tensor([p.temperature if p.temperature not in (0.0, 1.0) else 1.0 for p in params])
    return apply_warpers(logits / temps[:, None], params)


def assert_same_truncation(ours: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    assert torch.equal(torch.isinf(ours), torch.isinf(ref)), f"{what}: different tokens kept"
    kept = ~torch.isinf(ref)
    torch.testing.assert_close(ours[kept], ref[kept], msg=what)


CONTROLS = {
    "temperature": [dict(temperature=t) for t in (0.3, 0.7, 1.0, 1.5, 2.0)],
    "top_k": [dict(top_k=k) for k in (0, 1, 5, 40, 10_000)],
    "top_p": [dict(top_p=p) for p in (1.0, 0.05, 0.5, 0.9, 0.99)],
    "min_p": [dict(min_p=m) for m in (0.0, 0.01, 0.1, 0.5, 1.0)],
    "typical_p": [dict(typical_p=m) for m in (1.0, 0.2, 0.5, 0.9, 0.95)],
    "combined": [
        dict(temperature=0.7, top_k=50, top_p=0.9),
        dict(temperature=1.3, top_p=0.8, min_p=0.05),
        dict(top_k=20, typical_p=0.7),
        dict(temperature=0.5, top_k=100, top_p=0.95, min_p=0.02, typical_p=0.9),
        dict(),
    ],
}


@pytest.mark.parametrize("control", list(CONTROLS))
def test_warpers_match_transformers_in_a_mixed_batch(control):
    params = [SamplingParams(do_sample=True, **kw) for kw in CONTROLS[control]]
    logits = random_logits(len(params), seed=len(control))
    ours = ours_warp(logits, params)
    for i, p in enumerate(params):
        assert_same_truncation(ours[i], hf_warp(logits[i], p), f"{control} row {i} {p}")


def test_repetition_penalty_matches_transformers():
    contexts = [[3, 7, 7, 150], [5], [0, 1, 2, 3, 4, 5, 6], [9, 9]]
    penalties = [1.3, 1.0, 0.8, 2.0]
    rows = [Row(SamplingParams(repetition_penalty=r), c, len(c)) for r, c in zip(penalties, contexts)]
    logits = random_logits(len(rows), seed=3)
    ours = apply_penalties(logits, rows)
    for i, (r, c) in enumerate(zip(penalties, contexts)):
        ref = RepetitionPenaltyLogitsProcessor(r)(torch.tensor([c]), logits[i : i + 1].clone())
        torch.testing.assert_close(ours[i], ref[0])  # penalty 1.0 (off): untouched on both sides


def test_frequency_and_presence_penalties_count_generated_tokens_only():
    # prompt [4, 4, 8]; generated [8, 8, 11]
    row = Row(SamplingParams(frequency_penalty=0.5, presence_penalty=0.25), token_ids=[4, 4, 8, 8, 8, 11], prompt_len=3)
    plain = Row(SamplingParams())
    logits = random_logits(2, seed=4)
    ours = apply_penalties(logits, [row, plain])
    expected = logits[0].clone()
    expected[8] -= 2 * 0.5 + 0.25
    expected[11] -= 1 * 0.5 + 0.25
    torch.testing.assert_close(ours[0], expected)  # token 4 only in the prompt: untouched
    torch.testing.assert_close(ours[1], logits[1])


def test_greedy_is_argmax_with_raw_logprobs():
    logits = random_logits(5, seed=5)
    rows = [Row(SamplingParams(), top_n=3) for _ in range(5)]
    out = Sampler()(logits, rows)
    assert out.token_ids == logits.argmax(-1).tolist()
    logp = logits.log_softmax(-1)
    torch.testing.assert_close(torch.tensor(out.logprobs), logp.max(-1).values)
    for i in range(5):
        assert out.top_ids[i] == logp[i].topk(3).indices.tolist()
        torch.testing.assert_close(torch.tensor(out.top_logprobs[i]), logp[i].topk(3).values)
    # temperature 0 is greedy even with do_sample
    assert SamplingParams(temperature=0.0, do_sample=True).greedy


def test_sampled_logprob_is_after_penalties_and_temperature_before_truncation():
    logits = random_logits(3, seed=6)
    params = [
        SamplingParams(do_sample=True, temperature=0.5, top_k=3, seed=1),
        SamplingParams(do_sample=True, temperature=2.0, top_p=0.5, repetition_penalty=1.5, seed=2),
        SamplingParams(),  # greedy in the same batch
    ]
    rows = [Row(p, token_ids=[1, 2, 3], prompt_len=3, top_n=2).seeded() for p in params]
    out = Sampler()(logits, rows)
    penalised = apply_penalties(logits, rows)
    for i, p in enumerate(params):
        t = p.temperature if not p.greedy else 1.0
        logp = (penalised[i] / t).log_softmax(-1)
        assert out.logprobs[i] == pytest.approx(logp[out.token_ids[i]].item(), abs=1e-5)
        assert out.top_ids[i] == logp.topk(2).indices.tolist()
    # the sampled tokens survived their own truncation
    assert out.token_ids[0] in logits[0].topk(3).indices.tolist()


def test_seeded_requests_do_not_depend_on_batch_composition():
    target = SamplingParams(do_sample=True, temperature=0.9, top_p=0.95, seed=1234)
    others = [
        SamplingParams(do_sample=True, seed=7),
        SamplingParams(),
        SamplingParams(do_sample=True, top_k=5),  # unseeded: shared generator
        SamplingParams(do_sample=True, temperature=1.5, seed=99),
    ]
    steps = [random_logits(5, seed=100 + s) for s in range(12)]

    def run(batch: list[SamplingParams], position: int) -> list[int]:
        rows = [Row(p).seeded() for p in batch]
        sampler = Sampler(seed=0)
        tokens = []
        for logits in steps:
            # the target always sees row 0, the others rows 1, 2, ...
            rest = list(logits[1 : len(batch)])
            lg = torch.stack(rest[:position] + [logits[0]] + rest[position:])
            tokens.append(sampler(lg, rows).token_ids[position])
        return tokens

    alone = run([target], 0)
    crowded = run(others[:2] + [target] + others[2:], 2)
    reordered = run([target] + others[::-1], 0)
    assert alone == crowded == reordered
    assert len(set(alone)) > 1  # it really sampled


def test_sampling_frequencies_follow_the_warped_distribution():
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0, 1.5, 0.2]])
    params = SamplingParams(do_sample=True, temperature=0.8, top_k=5)
    n = 20000
    out = Sampler(seed=0)(logits.expand(n, -1), [Row(params)] * n)
    freq = torch.bincount(torch.tensor(out.token_ids), minlength=8).float() / n
    expected = hf_warp(logits[0], params).softmax(-1)
    assert (freq - expected).abs().max() < 0.015
    assert freq[expected == 0].sum() == 0


def test_params_from_proto():
    p = SamplingParams.from_pb(pb.NextTokenChooserParameters())  # all zero: greedy, everything off
    assert p.greedy and p.top_p == 1.0 and p.typical_p == 1.0 and p.repetition_penalty == 1.0 and p.seed is None
    p = SamplingParams.from_pb(pb.NextTokenChooserParameters(temperature=0.7, top_p=0.9, seed=5, has_seed=True))
    assert p.greedy and p.seed == 5  # warpers without do_sample: the router decides sampling, the shard obeys
    p = SamplingParams.from_pb(pb.NextTokenChooserParameters(temperature=0.7, top_p=0.9, do_sample=True))
    assert not p.greedy
    p = SamplingParams.from_pb(pb.NextTokenChooserParameters(temperature=1.0, seed=5))
    assert p.greedy and p.seed is None
    for bad in (dict(temperature=-1.0), dict(min_p=1.5), dict(top_p=-0.1), dict(repetition_penalty=-2.0),
                dict(temperature=float("nan"))):  # fmt: skip
        with pytest.raises(ValueError):
            SamplingParams.from_pb(pb.NextTokenChooserParameters(**bad))


def test_incremental_penalty_counts_equal_a_recount():
    prompt, steps = [4, 4, 9, 17], [[9], [3, 3, 150], [4], [199]]
    state = PenaltyState.from_tokens(prompt, len(prompt), VOCAB, "cpu")
    context = list(prompt)
    for new in steps:
        state.add(new)
        context += new
        fresh = PenaltyState.from_tokens(context, len(prompt), VOCAB, "cpu")
        assert torch.equal(state.seen, fresh.seen) and torch.equal(state.counts, fresh.counts)
    assert state.counts[3] == 2 and state.counts[4] == 1 and state.seen[17] and not state.seen[5]


def test_full_pipeline_matches_a_transformers_processor_list():
    """penalty -> temperature -> top-k -> top-p -> min-p -> typical, per row of a mixed batch."""
    from transformers import LogitsProcessorList

    ctx = [3, 7, 7, 150, 8]
    params = [
        SamplingParams(do_sample=True, temperature=0.7, top_k=30, top_p=0.9, repetition_penalty=1.3),
        SamplingParams(do_sample=True, temperature=1.4, min_p=0.05, typical_p=0.8, repetition_penalty=0.9),
        SamplingParams(do_sample=True, top_p=0.6),
        SamplingParams(repetition_penalty=1.2),  # greedy: one-hot at the penalised argmax
    ]
    rows = [Row(p, ctx, len(ctx)) for p in params]
    logits = random_logits(len(rows), seed=11)
    sampler = Sampler(seed=0)
    probs = sampler.target_probs(sampler.shape(logits, rows), rows)
    for i, p in enumerate(params):
        procs = LogitsProcessorList([RepetitionPenaltyLogitsProcessor(p.repetition_penalty)])
        ref = procs(torch.tensor([ctx]), logits[i : i + 1].clone())[0]
        if p.greedy:
            assert probs[i].argmax() == ref.argmax() and probs[i].max() == 1.0
            continue
        torch.testing.assert_close(probs[i], hf_warp(ref, p).softmax(-1), atol=1e-6, rtol=1e-5)


def test_grammar_mask_constrains_the_draw_but_not_the_reported_logprobs():
    from pagemill.sampling import GrammarMask

    logits = random_logits(3, seed=12)
    rows = [Row(SamplingParams(), top_n=2), Row(SamplingParams(do_sample=True, top_k=3, seed=1)).seeded(),
            Row(SamplingParams())]  # fmt: skip
    allowed = torch.zeros(2, VOCAB, dtype=torch.bool)
    allowed[0, [11, 12]] = True
    allowed[1, [40, 41, 42, 43, 44]] = True
    out = Sampler(seed=0)(logits, rows, GrammarMask([0, 1], allowed))
    assert out.token_ids[0] == 11 + int(logits[0, 12] > logits[0, 11])
    assert out.token_ids[1] in range(40, 45) and out.token_ids[2] == int(logits[2].argmax())
    logp = logits.log_softmax(-1)
    assert out.logprobs[0] == pytest.approx(logp[0, out.token_ids[0]].item(), abs=1e-5)
    assert out.top_ids[0] == logp[0].topk(2).indices.tolist()  # the model's own alternatives


def test_eos_ids_from_generation_config_and_ignore_eos(tmp_path):
    import json

    from conftest import build_model_dir
    from test_speculative import generate, make_runner

    model_dir = build_model_dir(str(tmp_path), "llama_gqa")
    ref = generate(make_runner(model_dir), [[5, 6, 7]], 8)[0].ids
    eos = next(t for t in ref[2:] if t not in ref[:2])  # first occurrence at some index >= 2
    gen = json.loads((tmp_path / "generation_config.json").read_text())
    gen["eos_token_id"] = [gen["eos_token_id"], eos]  # config.json keeps the single id 2
    (tmp_path / "generation_config.json").write_text(json.dumps(gen))
    out = generate(make_runner(model_dir), [[5, 6, 7]], 8, ignore_eos=False)[0]
    assert out.ids == ref[: ref.index(eos) + 1] and out.finish == pb.FINISH_REASON_EOS_TOKEN
    out = generate(make_runner(model_dir), [[5, 6, 7]], 8, ignore_eos=True)[0]
    assert out.ids == ref and out.finish == pb.FINISH_REASON_LENGTH


def test_logit_bias_shifts_logits_per_row_and_forces_a_token():
    logits = random_logits(3, seed=21)
    weakest = int(logits[0].argmin())
    rows = [Row(SamplingParams(logit_bias=((weakest, 100.0),))),  # greedy: +100 wins
            Row(SamplingParams(logit_bias=((int(logits[1].argmax()), -100.0),))),  # the argmax is pushed out
            Row(SamplingParams())]  # fmt: skip
    out = Sampler(seed=0)(logits, rows)
    assert out.token_ids[0] == weakest
    second = int(logits[1].topk(2).indices[1])
    assert out.token_ids[1] == second and out.token_ids[2] == int(logits[2].argmax())
    # Reported logprobs are of the biased distribution, as the request shaped it.
    biased = logits[0].clone()
    biased[weakest] += 100.0
    assert out.logprobs[0] == pytest.approx(biased.log_softmax(-1)[weakest].item(), abs=1e-5)
    assert torch.equal(logits, random_logits(3, seed=21))  # the caller's tensor is left alone


def test_logit_bias_applies_before_temperature_and_warpers():
    from pagemill.sampling import apply_logit_bias

    logits = random_logits(2, seed=22)
    params = [SamplingParams(logit_bias=((3, 2.5), (7, -1.0))), SamplingParams()]
    shifted = apply_logit_bias(logits, params)
    expected = logits.clone()
    expected[0, 3] += 2.5
    expected[0, 7] -= 1.0
    torch.testing.assert_close(shifted, expected)
    p = SamplingParams(do_sample=True, temperature=0.5, top_k=4, logit_bias=((3, 2.5),), seed=9)
    probs = Sampler(seed=0).target_probs(Sampler(seed=0).shape(logits[:1], [Row(p)]), [Row(p)])
    torch.testing.assert_close(probs[0], hf_warp(expected[0], p).softmax(-1))


def test_banned_tokens_cannot_be_drawn_but_keep_their_logprob():
    logits = random_logits(2, seed=23)
    best = int(logits[0].argmax())
    rows = [Row(SamplingParams()), Row(SamplingParams(do_sample=True, seed=3)).seeded()]
    top = logits[1].topk(3).indices.tolist()
    out = Sampler(seed=0)(logits, rows, banned={0: [best], 1: [t for t in range(VOCAB) if t not in top]})
    assert out.token_ids[0] == int(logits[0].topk(2).indices[1])
    assert out.token_ids[1] in top
    assert out.logprobs[0] == pytest.approx(logits[0].log_softmax(-1)[out.token_ids[0]].item(), abs=1e-5)


def test_logit_bias_from_proto():
    p = SamplingParams.from_pb(pb.NextTokenChooserParameters(logit_bias={504: 100.0, 7: -3.5}))
    assert p.logit_bias == ((7, -3.5), (504, 100.0))
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams.from_pb(pb.NextTokenChooserParameters(logit_bias={1: float("inf")}))


def test_stop_token_ids_and_min_new_tokens_on_the_shard(tmp_path):
    from conftest import build_model_dir
    from test_speculative import generate, make_runner

    model_dir = build_model_dir(str(tmp_path), "llama_gqa")
    ref = generate(make_runner(model_dir), [[5, 6, 7]], 10)[0].ids
    stop = next(t for t in ref[2:] if t not in ref[:2])  # first occurrence at some index >= 2
    at = ref.index(stop)
    out = generate(make_runner(model_dir), [[5, 6, 7]], 10, stop_token_ids=[stop])[0]
    assert out.ids == ref[: at + 1] and out.finish == pb.FINISH_REASON_STOP_SEQUENCE
    # Before min_new_tokens the stop token (and EOS) is never drawn; afterwards it stops again.
    out = generate(make_runner(model_dir), [[5, 6, 7]], 10, stop_token_ids=[stop], min_new_tokens=at + 2)[0]
    assert stop not in out.ids[: at + 2] and out.ids[:at] == ref[:at]
    assert out.finish in (pb.FINISH_REASON_STOP_SEQUENCE, pb.FINISH_REASON_LENGTH)
    assert len(out.ids) >= at + 2
    # ignore_eos=False with EOS banned until 10 tokens: exactly 10 come out, none of them EOS.
    eos = make_runner(model_dir).eos_ids
    out = generate(make_runner(model_dir), [[5, 6, 7]], 10, ignore_eos=False, min_new_tokens=10)[0]
    assert len(out.ids) == 10 and not eos & set(out.ids)
