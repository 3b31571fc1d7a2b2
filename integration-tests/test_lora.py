"""LoRA adapters through `pagemill launch --enable-lora` on a tiny random Llama: adapters chosen
per request by `model` (the `openai` client) and TGI's `adapter_id`, listed by /v1/models,
loaded and unloaded at run time, unknown ones refused with 404 in each API's shape; greedy
tokens of each adapter equal PEFT's merged model; the prefix cache never hands one adapter's
blocks to another; requests for more adapters than --max-loras wait and all finish."""

import concurrent.futures as cf
import json

import httpx
import openai
import pytest

from server import error_code, launch
from tiny_models import hf_greedy, save_tiny_model

CONFIG = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=1024, tie_word_embeddings=False)
PROMPTS = ["the quick brown fox", "seven wise owls count silver stars over the", "a lazy dog"]
MAX_NEW = 8
# name -> (rank, targets, rslora): two ranks, attention only and every projection.
ADAPTERS = {
    "sql": (8, ["q_proj", "k_proj", "v_proj", "o_proj"], False),
    "chat": (16, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], True),
    "summary": (4, ["v_proj", "down_proj"], False),
}


def save_adapter(base_dir, out, rank, targets, rslora, seed):
    """A PEFT adapter with random, nonzero lora_B (PEFT starts B at zero: a no-op adapter)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    cfg = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets, use_rslora=rslora, lora_dropout=0.0)
    peft_model = get_peft_model(model, cfg)
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                p.normal_(0.0, 0.2)
    peft_model.save_pretrained(out)
    return out


def merged_greedy(base_dir, adapter_dir, out, prompts):
    """PEFT's merged model (base + B A x scaling folded into the weights), greedy in transformers."""
    import shutil

    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    merged = PeftModel.from_pretrained(base, adapter_dir).merge_and_unload()
    merged.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(base_dir / name, out / name)
    return hf_greedy(out, prompts, MAX_NEW)


@pytest.fixture(scope="module")
def lora(tmp_path_factory, default_model_dir):
    root = tmp_path_factory.mktemp("lora")
    base = save_tiny_model(root / "base", default_model_dir, "LlamaConfig", **CONFIG)
    dirs = {name: save_adapter(base, root / name, r, t, rs, seed)
            for seed, (name, (r, t, rs)) in enumerate(ADAPTERS.items())}
    refs = {name: merged_greedy(base, d, root / f"merged-{name}", PROMPTS) for name, d in dirs.items()}
    refs[None] = hf_greedy(base, PROMPTS, MAX_NEW)
    # sql and chat from launch (both forms of --lora-modules); summary is loaded at run time.
    modules = ["--lora-modules", f"sql={dirs['sql']}", json.dumps({"name": "chat", "path": str(dirs["chat"])})]
    s = launch(str(base), "--enable-lora", *modules, "--max-loras", "2", "--max-lora-rank", "16",
               "--model-id", "tiny-llama", "--max-input-tokens", "256", "--max-total-tokens", "512",
               "--max-batch-prefill-tokens", "512", "--kv-cache-memory", "16MiB", "--block-size", "4")
    yield s, dirs, refs
    assert s.stop() == 0, s.logs()


def tgi(server, prompt, adapter=None, max_new=MAX_NEW):
    params = {"max_new_tokens": max_new, "details": True}
    if adapter:
        params["adapter_id"] = adapter
    return httpx.post(f"{server.url}/generate", json={"inputs": prompt, "parameters": params}, timeout=120)


def tokens(r):
    assert r.status_code == 200, r.text
    return [t["id"] for t in r.json()["details"]["tokens"]]


def test_models_lists_the_base_and_each_adapter_with_its_parent(lora):
    server, dirs, _ = lora
    data = httpx.get(f"{server.url}/v1/models", timeout=10).json()["data"]
    by_id = {m["id"]: m for m in data}
    assert data[0]["id"] == "tiny-llama" and data[0]["parent"] is None
    for name in ("sql", "chat"):
        assert by_id[name]["parent"] == "tiny-llama"
        assert by_id[name]["root"] == str(dirs[name])


def test_mixed_adapters_in_one_batch_equal_peft_merged_models(lora):
    server, _, refs = lora
    jobs = [(name, i) for name in (None, "sql", "chat") for i in range(len(PROMPTS))]
    with cf.ThreadPoolExecutor(len(jobs)) as pool:
        got = list(pool.map(lambda j: tokens(tgi(server, PROMPTS[j[1]], j[0])), jobs))
    for (name, i), ids in zip(jobs, got):
        assert ids == refs[name][i], f"{name} on {PROMPTS[i]!r}"
    assert refs["sql"] != refs[None] and refs["chat"] != refs[None], "the adapters change the output"


def test_the_openai_client_picks_the_adapter_by_model(lora):
    server, _, refs = lora
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)
    texts = {}
    for name in ("tiny-llama", "sql", "chat"):
        r = client.completions.create(model=name, prompt=PROMPTS[0], max_tokens=MAX_NEW, temperature=0)
        assert r.model == name
        texts[name] = r.choices[0].text
    # The same adapter over TGI's route gives the same text; each adapter its own.
    for name in ("sql", "chat"):
        body = tgi(server, PROMPTS[0], name).json()
        assert body["generated_text"] == texts[name]
    assert len(set(texts.values())) == 3
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="no-such-adapter", messages=[{"role": "user", "content": "hi"}])
    assert "no-such-adapter" in str(e.value)


def test_an_unknown_adapter_is_a_404_in_each_apis_shape(lora):
    server, _, _ = lora
    r = tgi(server, "hi", "no-such-adapter")
    assert r.status_code == 404 and error_code(r.json()) == "not_found", r.text
    r = httpx.post(f"{server.url}/v1/completions", json={"model": "nope", "prompt": "hi", "max_tokens": 2})
    assert r.status_code == 404, r.text
    assert r.json()["error"]["param"] == "model" and r.json()["error"]["code"] == "not_found"
    r = httpx.post(f"{server.url}/v1/messages", json={"model": "nope", "max_tokens": 2,
                                                        "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error", r.text


def test_adapters_load_and_unload_at_run_time(lora, tmp_path):
    server, dirs, refs = lora
    post = lambda route, body: httpx.post(f"{server.url}/v1/{route}", json=body, timeout=30)  # noqa: E731
    r = post("load_lora_adapter", {"lora_name": "summary", "lora_path": str(dirs["summary"])})
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'summary' added successfully.", r.text
    r = post("load_lora_adapter", {"lora_name": "summary", "lora_path": str(dirs["summary"])})
    assert r.status_code == 400 and "already been loaded" in r.json()["error"]["message"]
    r = post("load_lora_adapter", {"lora_name": "x", "lora_path": str(tmp_path / "missing")})
    assert r.status_code == 400 and "not a directory" in r.json()["error"]["message"]
    big = save_adapter(dirs["sql"].parent / "base", tmp_path / "big", 32, ["q_proj"], False, 9)
    r = post("load_lora_adapter", {"lora_name": "big", "lora_path": str(big)})
    assert r.status_code == 400 and "--max-lora-rank 16" in r.json()["error"]["message"]
    assert "summary" in [m["id"] for m in httpx.get(f"{server.url}/v1/models").json()["data"]]
    # Three adapters with --max-loras 2: requests wait for a slot, none is refused.
    jobs = [(name, i) for name in ("sql", "chat", "summary") for i in range(len(PROMPTS))]
    with cf.ThreadPoolExecutor(len(jobs)) as pool:
        got = list(pool.map(lambda j: tokens(tgi(server, PROMPTS[j[1]], j[0])), jobs))
    for (name, i), ids in zip(jobs, got):
        assert ids == refs[name][i], f"{name} on {PROMPTS[i]!r}"
    r = post("unload_lora_adapter", {"lora_name": "summary"})
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'summary' removed successfully.", r.text
    assert tgi(server, "hi", "summary").status_code == 404
    r = post("unload_lora_adapter", {"lora_name": "summary"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"


def test_prefix_cache_hits_never_cross_adapters(lora):
    server, _, _ = lora
    prompt = "one two three four five six seven eight nine ten eleven twelve thirteen fourteen"
    hits = lambda: server.metric("pagemill_prefix_hit_tokens_total")  # noqa: E731
    base = tokens(tgi(server, prompt, None, 2))
    before = hits()
    sql = tokens(tgi(server, prompt, "sql", 2))
    assert hits() == before, "the base model's blocks were not reused for an adapter"
    assert tokens(tgi(server, prompt, "sql", 2)) == sql
    after_sql = hits()
    assert after_sql > before, "the adapter's own blocks are reused"
    tokens(tgi(server, prompt, "chat", 2))
    assert hits() == after_sql, "nor one adapter's for another"
    assert tokens(tgi(server, prompt, None, 2)) == base


def test_metrics_count_requests_per_adapter(lora):
    server, _, _ = lora
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    assert any(line.startswith('pagemill_lora_requests_total{adapter="sql"} ') for line in text.splitlines())
    info = next(line for line in text.splitlines() if line.startswith("vllm:lora_requests_info{"))
    assert 'max_lora="2"' in info
