"""`pagemill launch --model tiny.gguf` on a random-weight model kept quantized (Q4_K attention,
Q8_0 MLP and embedding): the launcher extracts the tokenizer and the GGUF's chat template, the
shard serves the file's blocks, and the openai client's greedy chat and completions (and the
TGI route's token ids) equal transformers' GGUF loader on the same file. That server runs the
torch reference path (--no-cpu-kernels: exact float arithmetic); a second one on the default
path serves every linear from the compiled quant kernels, whose int8 rounding of activations
(as llama.cpp's) may move a near-tie, so its first token is checked, and its text is
well-formed."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import httpx
import openai
import pytest
import torch
from server import launch

sys.path.insert(0, str(Path(__file__).parent.parent / "tests"))

from gguf import GGMLQuantizationType as T  # noqa: E402
from gguf_vocab import byte_level_vocab  # noqa: E402
from gguf_writer import write_gguf  # noqa: E402

MAX_NEW = 12
MESSAGES = [[{"role": "user", "content": "Tell me about the capital of France."}],
            [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Numbers: 12345 and 3.14"}]]
PROMPTS = ["The quick brown fox", "def main():\n    print("]


def types(name: str, shape: tuple[int, ...]) -> T:
    return T.F32 if len(shape) < 2 else T.Q4_K if "attn" in name else T.Q8_0


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    tmp = tmp_path_factory.mktemp("gguf-serve")
    config = LlamaConfig(vocab_size=320, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024, bos_token_id=1,
                         eos_token_id=2)  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # larger than the default init, so that greedy tokens vary
        for name, p in model.named_parameters():
            p.uniform_(0.5, 1.5) if "norm" in name else p.normal_(0.0, 0.15)
    model.save_pretrained(tmp / "hf")
    return write_gguf(tmp / "hf", tmp / "tiny-q4k-q8.gguf", byte_level_vocab(320), types)[0]


@pytest.fixture(scope="module")
def server(gguf_file, tmp_path_factory):
    s = launch(str(gguf_file), "--cache-dir", str(tmp_path_factory.mktemp("cache")), "--kv-cache-memory", "64MiB",
               "--max-input-tokens", "256", "--max-total-tokens", "512", "--no-cpu-kernels")  # fmt: skip
    yield s
    s.stop()


@pytest.fixture(scope="module")
def reference(gguf_file):
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
    model = transformers.AutoModelForCausalLM.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name,
                                                              dtype=torch.float32).eval()  # fmt: skip
    return tok, model


def greedy(reference, ids: list[int]) -> list[int]:
    tok, model = reference
    x = torch.tensor([ids])
    with torch.no_grad():
        out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=MAX_NEW, do_sample=False,
                             eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id)  # fmt: skip
    new = out[0, len(ids) :].tolist()
    return new[: new.index(tok.eos_token_id)] if tok.eos_token_id in new else new


def text_of(reference, ids: list[int]) -> str:
    """What the server streams for these ids: a last character whose UTF-8 bytes are not all
    there yet is held back (the random model ends on partial characters), not sent as U+FFFD."""
    return reference[0].decode(ids, skip_special_tokens=True).rstrip("\ufffd")


def test_served_from_the_gguf(server, gguf_file):
    info = server.info()
    assert info["model_id"].startswith("tiny-q4k-q8")
    assert "weights kept quantized" in server.logs() and "Q4_K" in server.logs()


def test_generate_token_ids(server, reference):
    tok, _ = reference
    for prompt in PROMPTS:
        r = httpx.post(f"{server.url}/generate", timeout=120, json={
            "inputs": prompt, "parameters": {"max_new_tokens": MAX_NEW, "details": True}})  # fmt: skip
        assert r.status_code == 200, r.text
        ids = [t["id"] for t in r.json()["details"]["tokens"]]
        expect = greedy(reference, tok(prompt).input_ids)
        assert ids[: len(expect)] == expect and len(ids) in (len(expect), len(expect) + 1), prompt


def test_openai_chat_uses_the_gguf_chat_template(server, reference):
    tok, _ = reference
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)
    for messages in MESSAGES:
        ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        ids = list(ids) if isinstance(ids, list) else list(ids["input_ids"])  # a BatchEncoding in transformers 5
        assert tok.decode(ids).startswith("<|im_start|>")  # the template stored in the GGUF
        reply = client.chat.completions.create(model="tiny", messages=messages, max_tokens=MAX_NEW, temperature=0)
        assert reply.usage.prompt_tokens == len(ids)
        assert reply.choices[0].message.content == text_of(reference, greedy(reference, ids))


def test_openai_completions(server, reference):
    tok, _ = reference
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)
    for prompt in PROMPTS:
        reply = client.completions.create(model="tiny", prompt=prompt, max_tokens=MAX_NEW, temperature=0)
        assert reply.choices[0].text == text_of(reference, greedy(reference, tok(prompt).input_ids))


def test_served_on_the_compiled_kernels(gguf_file, reference, tmp_path_factory):
    from pagemill.cpu_kernels.quant import quant_kernel

    if quant_kernel() is None:
        pytest.skip("the compiled quant kernels are not built here")
    tok, _ = reference
    s = launch(str(gguf_file), "--cache-dir", str(tmp_path_factory.mktemp("cache-k")), "--kv-cache-memory", "64MiB",
               "--max-input-tokens", "256", "--max-total-tokens", "512")  # fmt: skip
    try:
        on = re.search(r"(\d+) of (\d+) linears on the compiled kernels", s.logs())
        assert on and on[1] == on[2] and int(on[1]) >= 9, on  # 2 layers x (qkv, o, gate|up, down) + the tied head
        for prompt in PROMPTS:
            r = httpx.post(f"{s.url}/generate", timeout=120, json={
                "inputs": prompt, "parameters": {"max_new_tokens": MAX_NEW, "details": True}})  # fmt: skip
            assert r.status_code == 200, r.text
            ids = [t["id"] for t in r.json()["details"]["tokens"]]
            assert len(ids) >= 1 and ids[0] == greedy(reference, tok(prompt).input_ids)[0], prompt
    finally:
        s.stop()
