"""EleutherAI's lm-evaluation-harness, unmodified, against the server: `local-completions` for
loglikelihood (multiple choice) and loglikelihood_rolling (perplexity) tasks, compared item by item
with lm-eval's own `hf` backend on the same float32 weights; `local-chat-completions` for a
generate_until task, compared with the server's own greedy answers. The tasks are small local ones
(integration-tests/data/lm_eval/), read with no hub access."""

import json
from pathlib import Path

import openai
import pytest

from server import launch
from tiny_models import save_tiny_model

ROOT = Path(__file__).resolve().parent.parent
TASKS = ROOT / "integration-tests" / "data" / "lm_eval"
SCORED = ["pagemill_mc", "pagemill_rolling"]
TOL = 1e-3


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, default_model_dir):
    return save_tiny_model(tmp_path_factory.mktemp("tiny-lm-eval"), default_model_dir, "LlamaConfig",
                           hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, max_position_embeddings=4096, tie_word_embeddings=True)


@pytest.fixture(scope="module")
def srv(model_dir):
    s = launch(str(model_dir), "--block-size", "16", "--kv-cache-memory", "64MiB", "--max-input-tokens", "2048",
               "--max-total-tokens", "2100", "--max-batch-prefill-tokens", "2100")
    yield s
    s.stop()


@pytest.fixture
def evaluate(monkeypatch):
    """lm_eval.simple_evaluate on the local tasks, offline, from the repository root (the task
    files name their data relative to it), with per-item results."""
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(ROOT)
    import lm_eval
    from lm_eval.tasks import TaskManager

    tasks = TaskManager(include_path=str(TASKS), include_defaults=False)

    def run(**kw):
        return lm_eval.simple_evaluate(task_manager=tasks, log_samples=True, **kw)

    return run


def per_item(result, task) -> dict:
    return {s["doc_id"]: s["filtered_resps"] for s in result["samples"][task]}


def test_loglikelihoods_match_the_hf_backend(srv, model_dir, evaluate):
    served = evaluate(model="local-completions", tasks=SCORED, model_args=(
        f"model=m,base_url={srv.url}/v1/completions,tokenizer={model_dir},tokenized_requests=False,max_retries=1"))
    hf = evaluate(model="hf", tasks=SCORED, model_args=f"pretrained={model_dir},dtype=float32", device="cpu",
                  batch_size=1)
    got, want = per_item(served, "pagemill_mc"), per_item(hf, "pagemill_mc")
    assert len(got) == len(want) == 20
    diffs = []
    for doc, choices in want.items():
        assert len(got[doc]) == len(choices) == 4
        for (ll, greedy), (ref, ref_greedy) in zip(got[doc], choices):
            diffs.append(abs(ll - ref))
            assert ll == pytest.approx(ref, abs=TOL), doc
            assert greedy == ref_greedy, doc
    assert any(ll != 0.0 for c in got.values() for ll, _ in c)
    got, want = per_item(served, "pagemill_rolling"), per_item(hf, "pagemill_rolling")
    assert len(got) == len(want) == 8
    for doc, (ref,) in want.items():
        diffs.append(abs(got[doc][0] - ref))
        assert got[doc][0] == pytest.approx(ref, abs=TOL), doc
    acc = served["results"]["pagemill_mc"]["acc,none"], hf["results"]["pagemill_mc"]["acc,none"]
    print(f"max |served - hf| over {len(diffs)} loglikelihoods: {max(diffs):.2e}; pagemill_mc acc {acc}")
    assert acc[0] == acc[1]


def test_generate_until_through_chat_completions_is_the_servers_greedy_answer(srv, evaluate):
    out = evaluate(model="local-chat-completions", tasks=["pagemill_gen"], apply_chat_template=True,
                   model_args=f"model=m,base_url={srv.url}/v1/chat/completions,max_retries=1")
    client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0, timeout=60)
    samples = out["samples"]["pagemill_gen"]
    assert len(samples) == 6 and any(s["resps"][0][0] for s in samples)
    for s in samples:
        # The chat as JSON text (lm-eval's JsonChatStr, a one-field tuple by the time it is logged),
        # and the task's generation_kwargs.
        context, gen_kwargs = s["arguments"][0]
        messages = json.loads(context[0])
        direct = client.chat.completions.create(model="m", messages=messages, temperature=0, stop=["\n"],
                                                max_tokens=gen_kwargs["max_gen_toks"], seed=1234)
        assert s["resps"][0][0] == direct.choices[0].message.content, s["doc_id"]
