"""tokenizer.json / tokenizer_config.json built from a GGUF's tokenizer metadata, against the
tokenizer transformers builds from the same file (AutoTokenizer.from_pretrained(dir, gguf_file=)).

Per tokenizer family llama.cpp writes: byte-level BPE under the pre-tokenizers of SmolLM
(digits one by one), Llama 3, Qwen2 and GPT-2; SentencePiece vocabularies shaped as Llama 2 /
Mistral, Gemma and Phi-3 ship them. Every text encodes to the same ids, with and without the
special tokens the post-processor adds (BOS), and decodes back to the same string.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import transformers
from gguf import GGUFWriter
from gguf_vocab import byte_level_vocab, sentencepiece_vocab
from gguf_writer import _vocab
from tokenizers import Tokenizer

from pagemill.models.gguf.files import write_small_files
from pagemill.models.gguf.reader import GGUFModel
from pagemill.models.gguf.tokenizer import build_tokenizer, end_of_generation_ids, read_spec

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "12345 and 3.14159, year 2024; 007",
    "héllo wörld — naïve café, 日本語のテキスト, emoji 🚀🔥",
    "  leading spaces\n\n\ttabs and newlines   trailing  ",
    "def main():\n    print('hello')\n",
    "a    b     c",
    "",
]
SPECIAL_TEXTS = {
    "gpt2": "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "llama": "<s>Hello</s> world",
    "gemma": "<start_of_turn>user\nHello<end_of_turn>\n<start_of_turn>model\n",
    "phi3": "<|user|>\nHello<|end|>\n<|assistant|>",
}
# (case, architecture, vocab)
CASES = {
    "smollm": ("llama", lambda: byte_level_vocab(320, "smollm")),
    "llama-bpe": ("llama", lambda: byte_level_vocab(320, "llama-bpe")),
    "qwen2": ("qwen2", lambda: byte_level_vocab(320, "qwen2")),
    "gpt2": ("llama", lambda: byte_level_vocab(320, "default")),
    "spm-llama": ("llama", lambda: sentencepiece_vocab(400, "llama")),
    "gemma": ("gemma3", lambda: sentencepiece_vocab(400, "gemma")),
    "phi3": ("phi3", lambda: sentencepiece_vocab(400, "phi3")),
}


def write_vocab_only(path: Path, arch: str, vocab) -> Path:
    """A GGUF with tokenizer metadata and no tensors (all a tokenizer reads)."""
    w = GGUFWriter(path, arch)
    _vocab(w, vocab)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
    arch, make = CASES[request.param]
    vocab = make()
    path = write_vocab_only(tmp_path_factory.mktemp(request.param) / "tok.gguf", arch, vocab)
    spec = read_spec(GGUFModel(path), 2048)
    ref = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    return request.param, vocab, spec, build_tokenizer(spec), ref


def test_encodes_like_transformers(case):
    name, vocab, spec, ours, ref = case
    family = "gpt2" if vocab.model == "gpt2" else name if name in ("gemma", "phi3") else "llama"
    for text in [*TEXTS, SPECIAL_TEXTS[family]]:
        for special in (False, True):
            expect = ref(text, add_special_tokens=special).input_ids
            assert ours.encode(text, add_special_tokens=special).ids == expect, (name, text, special)
        ids = ours.encode(text, add_special_tokens=False).ids
        assert ours.decode(ids, skip_special_tokens=False) == ref.decode(ids, skip_special_tokens=False), (name, text)


def test_specials_and_digits(case):
    name, vocab, _, ours, _ = case
    control = [t for t, ty in zip(vocab.tokens, vocab.token_types) if ty == 3]
    for t in control:  # matched whole in text, never split
        assert ours.encode(t, add_special_tokens=False).ids == [vocab.tokens.index(t)], t
    if name == "smollm":  # llama.cpp's SmolLM split: each digit on its own
        assert ours.encode("12345", add_special_tokens=False).tokens == list("12345")


def test_small_files_carry_template_and_end_of_turn(tmp_path):
    vocab = sentencepiece_vocab(400, "gemma")
    path = write_vocab_only(tmp_path / "g.gguf", "gemma3", vocab)
    spec = read_spec(GGUFModel(path), 2048)
    assert end_of_generation_ids(spec) == [vocab.ids["eos"], vocab.tokens.index("<end_of_turn>")]
    out = tmp_path / "dir"
    out.mkdir()
    g = GGUFModel(write_tiny_gemma(tmp_path, vocab))
    write_small_files(g, out)
    cfg = json.loads((out / "tokenizer_config.json").read_text())
    assert cfg["chat_template"] == vocab.chat_template and cfg["bos_token"] == "<bos>" and cfg["add_bos_token"]
    gen = json.loads((out / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [vocab.ids["eos"], vocab.tokens.index("<end_of_turn>")]
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    assert tok.encode("Hi").ids[0] == vocab.ids["bos"]  # add_bos_token: the post-processor adds it
    rendered = transformers.AutoTokenizer.from_pretrained(out).apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True)
    assert rendered == "<bos><start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n"


def write_tiny_gemma(tmp_path: Path, vocab) -> Path:
    from conftest import build_model_dir
    from gguf import GGMLQuantizationType as T
    from gguf_writer import write_gguf

    kwargs = dict(num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                  query_pre_attn_scalar=32, vocab_size=len(vocab.tokens))  # fmt: skip
    model_dir = build_model_dir(str(tmp_path / "hf"), "g", variants={"g": ("Gemma3TextConfig", kwargs, {})})
    return write_gguf(model_dir, tmp_path / "tiny.gguf", vocab, T.Q8_0)[0]
