"""`--model file.gguf` as the launcher and the shards see it: the router's files extracted once
into the cache with a manifest, the shard loading the weights from the GGUF itself (kept
quantized, or dequantized with --gguf-weights dequantized), and what is refused up front."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import ROOT, build_model_dir
from gguf import GGMLQuantizationType as T
from gguf_vocab import byte_level_vocab
from gguf_writer import write_gguf
from test_model import PagedHarness, prompts

from pagemill.config import check_gguf
from pagemill.models.default_model import resolve_model
from pagemill.models.gguf.extract import MANIFEST_NAME, gguf_source
from pagemill.models.gguf.linear import GGUFLinear
from pagemill.models.gguf.types import GGUFError
from pagemill.models.loader import load_model
from pagemill.parallel.group import ParallelGroup

KW = dict(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serve")
    model_dir = build_model_dir(str(tmp / "hf"), "q", variants={"q": ("Qwen2Config", KW, {})})
    return write_gguf(model_dir, tmp / "tiny.gguf", byte_level_vocab(320), T.Q8_0)[0]


def test_extraction_is_cached_and_redone_when_the_file_changes(gguf_file, tmp_path):
    out = resolve_model(str(gguf_file), cache_dir=tmp_path)
    assert out.parent == tmp_path / "gguf" and out.name == f"tiny-{gguf_file.stat().st_size}"
    names = sorted(p.name for p in out.iterdir())
    assert names == sorted(["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                            MANIFEST_NAME])  # no weights: they stay in the GGUF  # fmt: skip
    manifest = json.loads((out / MANIFEST_NAME).read_text())
    assert manifest["files"] == [{"path": str(gguf_file.resolve()), "size": gguf_file.stat().st_size,
                                  "mtime_ns": gguf_file.stat().st_mtime_ns}]  # fmt: skip
    assert json.loads((out / "config.json").read_text())["model_type"] == "qwen2"
    assert gguf_source(out) == gguf_file.resolve()
    stamp = (out / MANIFEST_NAME).stat().st_mtime_ns
    assert resolve_model(str(gguf_file), cache_dir=tmp_path) == out and (out / MANIFEST_NAME).stat().st_mtime_ns == stamp
    os.utime(gguf_file, ns=(stamp, stamp + 10**9))  # the file replaced (same size, new mtime): extracted again
    resolve_model(str(gguf_file), cache_dir=tmp_path)
    assert json.loads((out / MANIFEST_NAME).read_text())["files"][0]["mtime_ns"] == stamp + 10**9
    assert not [p for p in tmp_path.rglob("*") if ".tmp-" in p.name or ".old-" in p.name]


def test_manifest_of_a_changed_file_is_refused(gguf_file, tmp_path):
    copy = tmp_path / "c.gguf"
    copy.write_bytes(gguf_file.read_bytes())
    out = resolve_model(str(copy), cache_dir=tmp_path)
    copy.write_bytes(gguf_file.read_bytes()[:-64])
    with pytest.raises(GGUFError, match="missing or changed size; launch again to re-extract"):
        load_model(str(out), "float32", "cpu")


def test_extracted_dir_serves_quantized_and_dequantized(gguf_file, tmp_path):
    out = resolve_model(str(gguf_file), cache_dir=tmp_path)
    tokens = prompts(320, [10])[0]
    logits = {}
    for weights in ("quantized", "dequantized"):
        model, config = load_model(str(out), "float32", "cpu", cpu_kernels=False, gguf_weights=weights)
        gguf = [m for m in model.modules() if isinstance(m, GGUFLinear)]
        assert bool(gguf) == (weights == "quantized")
        logits[weights] = PagedHarness(model, config).prefill({0: tokens})[0]
    rel = (logits["quantized"] - logits["dequantized"]).abs().max() / logits["dequantized"].abs().max()
    assert rel < 1e-5


def test_dequantized_path_takes_int8(gguf_file):
    model, _ = load_model(str(gguf_file), "float32", "cpu", cpu_kernels=False, gguf_weights="dequantized",
                          quantize="int8")  # fmt: skip
    assert model.model.layers[0].self_attn.qkv_proj.qweight.dtype == torch.int8


def test_refusals():
    with pytest.raises(ValueError, match="runs on one shard .* --gguf-weights dequantized shards it"):
        check_gguf("quantized", 2, None)
    with pytest.raises(ValueError, match="--quantize int8 re-quantizes float weights"):
        check_gguf("quantized", 1, "int8")
    check_gguf("dequantized", 2, "int8")  # the float path decides those


def test_shard_refuses_tensor_parallel_quantized(gguf_file):
    with pytest.raises(ValueError, match="runs on one shard"):
        load_model(str(gguf_file), "float32", "cpu", group=ParallelGroup(0, 2, "cpu", initialised=False))


def test_launch_refuses_before_starting_shards(gguf_file, tmp_path):
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "server"))
    run = subprocess.run([sys.executable, "-m", "pagemill", "launch", "--model", str(gguf_file), "--num-shard", "2",
                          "--cache-dir", str(tmp_path)], capture_output=True, text=True, env=env, timeout=120)  # fmt: skip
    assert run.returncode == 1, run.stderr
    assert "a GGUF model kept quantized runs on one shard (got 2)" in run.stderr
