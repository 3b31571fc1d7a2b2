"""Speculative decoding: n-gram proposer, exact verification, greedy identity, distribution.

`generate` plays the router (bench/block_router.py BlockRouter) against an
in-process ModelRunner: room for speculate proposals per decode entry, each
sequence advanced by the number of tokens returned (the router's implicit
rollback of rejected slots).
"""

from __future__ import annotations

import glob
import os
import random
import shutil

import pytest
import torch

from conftest import build_model_dir
from pagemill.models.loader import load_model
from pagemill.proto import pb
from pagemill.sampling import Sampler, SamplingParams
from pagemill.shard.model_runner import ModelRunner
from pagemill.bench.block_router import BlockRouter, Output
from pagemill.speculative.draft import DraftProposer
from pagemill.speculative.ngram import propose_ngram
from pagemill.speculative.verify import verify

BLOCK = 4


def make_runner(model_dir: str, speculate: int = 0, draft_dir: str | None = None, blocks: int = 600,
                seed: int = 0) -> ModelRunner:  # fmt: skip
    model, config = load_model(model_dir)
    draft = None
    if draft_dir is not None:
        d_model, d_config = load_model(draft_dir)
        draft = DraftProposer(d_model, d_config, "cpu", BLOCK)
    per_block = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * BLOCK * 4
    if draft is not None:
        per_block += 2 * d_config.num_hidden_layers * d_config.num_key_value_heads * d_config.head_dim * BLOCK * 4
    runner = ModelRunner(model, config, block_size=BLOCK, kv_cache_memory=blocks * per_block, model_dir=model_dir,
                         speculate=speculate, draft=draft)  # fmt: skip
    runner.warmup(pb.WarmupRequest(max_batch_prefill_tokens=64, max_input_tokens=32, max_total_tokens=128,
                                   max_batch_size=4))  # fmt: skip
    runner.sampler = Sampler(seed=seed)
    return runner


def generate(runner: ModelRunner, prompts, max_new: int, *, ignore_eos: bool = True, **kw) -> dict[int, Output]:
    """Every prompt in one BlockRouter run: first step all prompts, then decode steps with
    speculate proposal slots each; returns {rid: Output}. kw: BlockRouter.add's."""
    return BlockRouter.for_runner(runner).generate(prompts, max_new, ignore_eos=ignore_eos, **kw)


def test_ngram_proposes_the_continuation_of_the_latest_match():
    assert propose_ngram([1, 2, 3, 4, 1, 2], 3) == [3, 4, 1]
    assert propose_ngram([9, 1, 2, 5, 1, 2, 7, 1, 2], 2) == [7, 1]  # most recent occurrence wins
    assert propose_ngram([5, 1, 2, 3, 8, 2, 3], 2) == [8, 2]  # longest suffix first: [2, 3] before [3]
    assert propose_ngram([1, 2, 3], 4) == [] and propose_ngram([4], 2) == [] and propose_ngram([1, 1], 0) == []


def chi_square_p(observed: torch.Tensor, expected: torch.Tensor, min_expected: float = 5.0) -> float:
    """p-value of Pearson's chi-square; cells expected < min_expected are pooled into one."""
    small = expected < min_expected
    obs = torch.cat([observed[~small], observed[small].sum()[None]]).double()
    exp = torch.cat([expected[~small], expected[small].sum()[None]]).double()
    keep = exp > 0
    stat = ((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum()
    df = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2.0, dtype=torch.float64), stat / 2))


class Row:
    def __init__(self, params: SamplingParams, generator=None) -> None:
        self.params, self.generator, self.penalties, self.top_n = params, generator, None, 0


@pytest.mark.parametrize("kind", ["point_mass", "draft"])
def test_verification_preserves_the_target_distribution(kind):
    """First emitted token of each request ~ p, whatever q proposes (V = 8, 20000 requests)."""
    g = torch.Generator().manual_seed(0)
    vocab, n = 8, 20000
    p = torch.softmax(torch.randn(vocab, generator=g) * 1.5, -1)
    q = torch.softmax(torch.randn(vocab, generator=g) * 1.5, -1)  # a deliberately different draft
    if kind == "point_mass":
        props = [[3]] * n  # always proposes token 3
        draft = None
    else:
        props = torch.multinomial(q, n, replacement=True, generator=g)[:, None].tolist()
        draft = q.expand(n, 1, vocab)
    target = p.expand(2 * n, vocab)  # rows: proposal position, bonus position
    rows = [Row(SamplingParams(do_sample=True))] * n
    out = verify(Sampler(seed=1), target, [2] * n, props, rows, draft)
    first = torch.tensor([t[0] for t in out])
    assert chi_square_p(torch.bincount(first, minlength=vocab).float(), p * n) > 0.01
    accepted = sum(len(t) == 2 for t in out) / n
    expected = p[3].item() if draft is None else torch.minimum(p, q).sum().item()
    assert accepted == pytest.approx(expected, abs=0.02)


def test_greedy_verification_accepts_while_equal_to_argmax():
    target = torch.zeros(4, 5)
    target[torch.arange(4), torch.tensor([1, 2, 3, 4])] = 1.0  # argmax at each position: 1, 2, 3 then bonus 4
    rows = [Row(SamplingParams())]
    assert verify(Sampler(seed=0), target, [4], [[1, 2, 3]], rows) == [[1, 2, 3, 4]]
    assert verify(Sampler(seed=0), target, [4], [[1, 0, 3]], rows) == [[1, 2]]
    assert verify(Sampler(seed=0), target[:1], [1], [[]], rows) == [[1]]


def perturbed_copy(model_dir: str, out_dir: str, noise: float, seed: int = 1) -> str:
    """The same architecture and vocab with noisy weights: a draft that is often, not always, right."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(model_dir, out_dir, dirs_exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    for path in glob.glob(os.path.join(out_dir, "*.safetensors")):
        tensors = {k: v + noise * torch.randn(v.shape, generator=g) for k, v in load_file(path).items()}
        save_file(tensors, path, metadata={"format": "pt"})
    return out_dir


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    target = build_model_dir(str(tmp_path_factory.mktemp("target")), "llama_gqa", seed=0)
    return target, perturbed_copy(target, str(tmp_path_factory.mktemp("draft")), noise=0.015)


def copy_heavy_prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    prompts = []
    for _ in range(n):
        span = [rng.randrange(3, 300) for _ in range(rng.randrange(3, 7))]
        prompts.append([rng.randrange(3, 300) for _ in range(rng.randrange(1, 5))] + span * 2 + span[:2])
    return prompts


@pytest.fixture(scope="module")
def baseline(models):
    prompts = copy_heavy_prompts(32)
    return prompts, generate(make_runner(models[0]), prompts, 20, top_n=2)


@pytest.mark.parametrize("method", ["ngram", "draft_same", "draft_other"])
def test_greedy_speculation_is_token_identical(models, baseline, method):
    target, other = models
    prompts, ref = baseline
    draft_dir = {"ngram": None, "draft_same": target, "draft_other": other}[method]
    runner = make_runner(target, speculate=4, draft_dir=draft_dir)
    per_gen = []  # tokens per decode Generation
    orig = runner.step

    def step(req):
        result = orig(req)
        if not any(e.HasField("new_request") for e in req.requests):
            per_gen.extend(len(g.tokens.ids) for g in result.generations)
        return result

    runner.step = step
    out = generate(runner, prompts, 20, top_n=2)
    for rid in ref:
        assert out[rid].ids == ref[rid].ids, f"request {rid}"
        assert out[rid].finish == ref[rid].finish == pb.FINISH_REASON_LENGTH
        assert out[rid].top == ref[rid].top
        torch.testing.assert_close(out[rid].logprobs, ref[rid].logprobs, atol=1e-4, rtol=1e-4)
    # Speculation really accepted tokens (1 per step without it); the same model as draft takes all 4.
    mean = sum(per_gen) / len(per_gen)
    print(f"{method}: {mean:.2f} tokens per request-step")
    assert mean > {"ngram": 1.02, "draft_same": 3.5, "draft_other": 1.2}[method]


def test_eos_and_max_new_tokens_inside_an_accepted_run(models, baseline):
    """Truncation: the run stops at EOS or at max_new_tokens even when more was accepted."""
    target, _ = models
    prompts, ref = baseline
    runner = make_runner(target, speculate=4, draft_dir=target)
    rid = 0
    eos = ref[rid].ids[7]
    first = ref[rid].ids.index(eos)
    runner.eos_ids = frozenset([eos])
    out = generate(runner, [prompts[rid]], 20, ignore_eos=False)[0]
    assert out.ids == ref[rid].ids[: first + 1] and out.finish == pb.FINISH_REASON_EOS_TOKEN
    out = generate(make_runner(target, speculate=4, draft_dir=target), [prompts[rid]], 6)[0]
    assert out.ids == ref[rid].ids[:6] and out.finish == pb.FINISH_REASON_LENGTH


def test_penalised_and_sampled_requests_in_a_speculative_batch(models, baseline):
    """Requests with penalties get no proposals and match the non-speculative run; seeded
    sampling with speculation is reproducible and independent of its batch companions."""
    target, other = models
    prompts = baseline[0][:6]
    pen = pb.NextTokenChooserParameters(repetition_penalty=1.5, frequency_penalty=0.3)
    seeded = pb.NextTokenChooserParameters(do_sample=True, temperature=0.8, top_p=0.9, seed=7, has_seed=True)
    params = [pen, seeded, pb.NextTokenChooserParameters()] * 2
    plain = generate(make_runner(target), prompts, 12, params=params)
    spec = generate(make_runner(target, speculate=3, draft_dir=other), prompts, 12, params=params)
    for rid in (0, 2, 3, 5):  # penalties, greedy
        assert spec[rid].ids == plain[rid].ids
    alone = generate(make_runner(target, speculate=3, draft_dir=other, seed=5), [prompts[1]], 12, params=[seeded])
    assert alone[0].ids == spec[1].ids


def tiny_vocab_model(path: str, seed: int, vocab: int = 12, scale: float = 0.4) -> str:
    import transformers

    config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                                      bos_token_id=0, eos_token_id=1)  # fmt: skip
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.uniform_(0.5, 1.5) if "norm" in name else p.normal_(0.0, scale)
    model.save_pretrained(path)
    return path


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_speculative_sampling_matches_the_target_distribution(tmp_path, method):
    """Chi-square of sampled (t1, t2), (t2, t3), (t3, t4) against the exact target joint,
    temperature 1, 6000 samples; t2..t4 come out of one verification step with 2 proposals."""
    from conftest import load_hf

    vocab, n, prompt = 12, 6000, [3, 4, 5, 3, 4, 5, 3]
    target = tiny_vocab_model(str(tmp_path / "target"), seed=0)
    draft = tiny_vocab_model(str(tmp_path / "draft"), seed=1) if method == "draft" else None
    runner = make_runner(target, speculate=3, draft_dir=draft, blocks=4 * n + 8, seed=123)
    params = pb.NextTokenChooserParameters(do_sample=True, temperature=1.0)
    out = generate(runner, [prompt] * n, 4, params=[params] * n)
    samples = torch.tensor([out[i].ids for i in range(n)])  # [n, 4]

    hf = load_hf(target)
    grid = torch.cartesian_prod(*[torch.arange(vocab)] * 3)  # every (t1, t2, t3)
    with torch.no_grad():
        logp = hf(torch.cat([torch.tensor(prompt).expand(len(grid), -1), grid], 1)).logits.log_softmax(-1)
    base = len(prompt) - 1
    joint = logp[:, base].gather(1, grid[:, :1]).squeeze(1)  # log P(t1)
    for j in (1, 2):
        joint = joint + logp[:, base + j].gather(1, grid[:, j : j + 1]).squeeze(1)
    joint = joint.exp().view(vocab, vocab, vocab)  # P(t1, t2, t3)
    p4 = (joint.view(-1, 1) * logp[:, base + 3].exp()).view(vocab, vocab, vocab, vocab)  # P(t1..t4)
    pairs = {(0, 1): p4.sum((2, 3)), (1, 2): p4.sum((0, 3)), (2, 3): p4.sum((0, 1))}
    for (a, b), exact in pairs.items():
        observed = torch.bincount(samples[:, a] * vocab + samples[:, b], minlength=vocab * vocab).float()
        p_value = chi_square_p(observed, exact.flatten() * n)
        assert p_value > 0.01, f"tokens {a + 1},{b + 1}: p = {p_value:.4f}"
