"""The Python parts of scripts/gpu_check.sh, on CPU: sweep arithmetic and driver, e2e scoring."""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

import gpu_e2e  # noqa: E402
import gpu_sweep  # noqa: E402


def test_bandwidth_arithmetic(llama_dir):
    from pagemill.models.loader import load_model

    model, config = load_model(llama_dir, torch.bfloat16, "cpu")
    embed = model.model.embed_tokens.weight.numel() * 2
    total = sum(p.numel() for p in model.parameters()) * 2
    assert gpu_sweep.weight_bytes(model) == total - embed  # untied: only a few embedding rows are read
    model.lm_head.weight = model.model.embed_tokens.weight  # tied: the embedding is the lm_head, read whole
    assert gpu_sweep.weight_bytes(model) == sum(p.numel() for p in model.parameters()) * 2
    # llama_gqa: 2 layers x 2 kv heads x head_dim 16, K and V, bf16
    assert gpu_sweep.kv_bytes_per_token(config, torch.bfloat16) == 2 * 2 * 2 * 16 * 2
    assert gpu_sweep.hbm_fraction(2.4e9, 1e-3) == pytest.approx(0.5)  # 2.4 GB in 1 ms of 4.8 TB/s


def test_sweep_runs_on_cpu(llama_dir, tmp_path, capsys):
    out = tmp_path / "sweep.json"
    assert gpu_sweep.main(["--model", llama_dir, "--backends", "torch", "--batches", "1,3", "--device", "cpu",
                           "--dtype", "float32", "--prompt-len", "20", "--steps", "3", "--json", str(out)]) == 0  # fmt: skip
    rows = json.loads(out.read_text())["rows"]
    assert [(r["backend"], r["batch"]) for r in rows] == [("torch", 1), ("torch", 3)]
    assert all(r["ttft_ms"] > 0 and r["decode_tokens_per_s"] > 0 and 0 < r["hbm_fraction"] < 1 for r in rows)
    assert gpu_sweep.HEADER in capsys.readouterr().out


def test_sweep_with_graphs_runs_the_static_buffers_on_cpu(llama_dir, tmp_path):
    out = tmp_path / "sweep.json"
    assert gpu_sweep.main(["--model", llama_dir, "--backends", "torch", "--graph-backends", "torch", "--batches", "3",
                           "--device", "cpu", "--dtype", "float32", "--prompt-len", "20", "--steps", "3",
                           "--json", str(out)]) == 0  # fmt: skip
    rows = json.loads(out.read_text())["rows"]
    assert [(r["backend"], r["cuda_graphs"]) for r in rows] == [("torch", False), ("torch", True)]
    assert all(r["decode_tokens_per_s"] > 0 for r in rows)


class _Tokenizer:
    eos_token_id = 2

    def __call__(self, text):
        return type("Encoding", (), {"input_ids": [int(t) for t in text.split()]})


def test_e2e_scores_tokens_teacher_forced(llama_dir):
    from conftest import load_hf

    model, tok = load_hf(llama_dir), _Tokenizer()
    prompt = "1 7 42 9 100 3"
    ids = torch.tensor([[1, 7, 42, 9, 100, 3]])
    greedy = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False,
                            pad_token_id=2)[0, 6:].tolist()  # fmt: skip
    same = gpu_e2e.compare(model, tok, prompt, greedy, margin=1e-4)
    assert same["ok"] and same["exact_prefix"] == 8 and same["max_logit_gap"] < 1e-4
    wrong = greedy[:5] + [(greedy[5] + 1) % 320] + greedy[6:]  # an off-argmax token at step 5
    worse = gpu_e2e.compare(model, tok, prompt, wrong, margin=1e-4)
    assert not worse["ok"] and worse["exact_prefix"] == 5 and worse["max_logit_gap"] > 1e-4
