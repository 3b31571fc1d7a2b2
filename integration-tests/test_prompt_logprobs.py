"""Prompt logprobs everywhere they are asked for, against transformers' per-token logprobs on the
same float32 weights: `echo` with `logprobs` and `max_tokens: 0` on /v1/completions (the unmodified
`openai` client), vLLM's `prompt_logprobs`, TGI's `decoder_input_details`. Every prompt goes in
prefill chunks of 32 tokens, and each is asked again after its prefix is cached: the reply is the
same, with no `null` past the first token."""

import httpx
import openai
import pytest

from server import launch
from tiny_models import save_tiny_model

TEXTS = [
    "The quick brown fox jumps over the lazy dog while the cat sleeps on the warm windowsill. " * 2,
    "In the beginning the universe was created. This has made a lot of people very angry and been "
    "widely regarded as a bad move. Many were increasingly of the opinion that they had all made a big "
    "mistake in coming down from the trees in the first place. " * 2,
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n\n" * 6,
]
TOL = 1e-4


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, default_model_dir):
    return save_tiny_model(tmp_path_factory.mktemp("tiny-scoring"), default_model_dir, "LlamaConfig",
                           hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, max_position_embeddings=4096, tie_word_embeddings=True)


@pytest.fixture(scope="module")
def reference(model_dir):
    """ids -> transformers' log_softmax rows: row i is the distribution of token i + 1."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()

    def rows(ids: list[int]):
        with torch.no_grad():
            return model(torch.tensor([ids])).logits[0].float().log_softmax(-1)

    return tok, rows


@pytest.fixture(scope="module")
def srv(model_dir):
    s = launch(str(model_dir), "--block-size", "16", "--prefill-chunk-tokens", "32", "--kv-cache-memory", "64MiB",
               "--max-input-tokens", "1024", "--max-total-tokens", "1100", "--max-batch-prefill-tokens", "1100")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(srv):
    return openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0, timeout=120)


def prefill_computed(srv) -> float:
    return srv.metric("pagemill_prefill_tokens_total")


def check_echo(choice, ids, rows, k: int) -> None:
    """The echoed prompt's entries against transformers: the first null, the rest within TOL."""
    lp = choice.logprobs
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset)
    for i in range(1, len(ids)):
        assert lp.token_logprobs[i] == pytest.approx(rows[i - 1, ids[i]].item(), abs=TOL), i
        want = rows[i - 1].topk(k).values.tolist()
        assert sorted(lp.top_logprobs[i].values(), reverse=True) == pytest.approx(want, abs=TOL), i
    offsets = [0]
    for t in lp.tokens[:-1]:
        offsets.append(offsets[-1] + len(t))
    assert lp.text_offset == offsets


def test_echo_logprobs_equal_transformers_with_and_without_a_cache_hit(srv, client, reference):
    tok, rows_of = reference
    for text in TEXTS:
        ids = tok(text).input_ids
        rows = rows_of(ids)
        out = client.completions.create(model="m", prompt=ids, echo=True, logprobs=2, max_tokens=1, temperature=0)
        choice = out.choices[0]
        assert len(choice.logprobs.tokens) == len(ids) + 1 and out.usage.prompt_tokens == len(ids)
        check_echo(choice, ids, rows, 2)
        # The generated token's entry comes last, greedy: its logprob is the best alternative's.
        assert choice.logprobs.token_logprobs[-1] == pytest.approx(max(choice.logprobs.top_logprobs[-1].values()),
                                                                   abs=TOL)
        # Again, and with another ending: the prefix comes from the KV cache, the logprobs from
        # beside its blocks; only the block before the new ending is computed again.
        other = ids + tok(" And then something else entirely happened.").input_ids
        for again in (ids, other):
            before = prefill_computed(srv)
            out = client.completions.create(model="m", prompt=again, echo=True, logprobs=2, max_tokens=1,
                                            temperature=0)
            computed = prefill_computed(srv) - before
            assert len(ids) >= 32 and computed <= len(again) - 16, (computed, len(again))
            check_echo(out.choices[0], again, rows_of(again), 2)


def test_a_prefix_cached_without_logprobs_is_scored_whole(srv, reference):
    """The issue's case: 960 of 1,000 tokens cached by a request that did not ask for logprobs, then
    /generate with decoder_input_details. Here 300 of 316."""
    tok, rows_of = reference
    ids = (tok(TEXTS[1]).input_ids * 3)[:300]
    head = tok.decode(ids)
    text = head + " A new ending to the story."
    httpx.post(f"{srv.url}/generate", json={"inputs": head, "parameters": {"max_new_tokens": 1}}, timeout=60)
    before = srv.metric("pagemill_prefix_hit_tokens_total")
    body = {"inputs": text, "parameters": {"max_new_tokens": 1, "decoder_input_details": True}}
    for _ in range(2):  # computed whole, then served from the stored logprobs
        prefill = httpx.post(f"{srv.url}/generate", json=body, timeout=60).json()["details"]["prefill"]
        got_ids = [t["id"] for t in prefill]
        rows = rows_of(got_ids)
        assert prefill[0]["logprob"] is None
        assert [t["logprob"] for t in prefill[1:]] == pytest.approx(
            [rows[i - 1, got_ids[i]].item() for i in range(1, len(got_ids))], abs=TOL)
    assert srv.metric("pagemill_prefix_hit_tokens_total") > before, "the second request hit the cache"


def test_max_tokens_0_scores_the_prompt_only(client, reference):
    tok, rows_of = reference
    text = TEXTS[0]
    ids = tok(text).input_ids
    out = client.completions.create(model="m", prompt=text, echo=True, logprobs=1, max_tokens=0, temperature=0)
    choice = out.choices[0]
    assert choice.text == text and choice.finish_reason == "length"
    assert out.usage.completion_tokens == 0 and len(choice.logprobs.tokens) == len(ids)
    check_echo(choice, ids, rows_of(ids), 1)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="m", prompt=text, max_tokens=0)
    assert e.value.param == "max_tokens"


def test_vllm_prompt_logprobs_with_alternatives(client, reference):
    tok, rows_of = reference
    ids = tok(TEXTS[2]).input_ids
    rows = rows_of(ids)
    out = client.completions.create(model="m", prompt=ids, max_tokens=1, temperature=0,
                                    extra_body={"prompt_logprobs": 3})
    got = out.choices[0].model_extra["prompt_logprobs"]
    assert len(got) == len(ids) and got[0] is None
    for i in range(1, len(ids)):
        entry = got[i][str(ids[i])]
        assert entry["logprob"] == pytest.approx(rows[i - 1, ids[i]].item(), abs=TOL)
        # Its rank: 1 + the tokens more likely, up to near-ties at float32 precision.
        lp = rows[i - 1, ids[i]]
        assert int((rows[i - 1] > lp + TOL).sum()) < entry["rank"] <= int((rows[i - 1] > lp - TOL).sum()) + 1
        top = rows[i - 1].topk(3)
        for rank, (tid, lp) in enumerate(zip(top.indices.tolist(), top.values.tolist()), 1):
            assert got[i][str(tid)]["logprob"] == pytest.approx(lp, abs=TOL)
            if tid != ids[i]:
                assert got[i][str(tid)]["rank"] == rank
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="m", prompt="a", max_tokens=1, extra_body={"prompt_logprobs": 50})
    assert e.value.param == "prompt_logprobs"
