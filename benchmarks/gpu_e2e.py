"""End to end on CUDA: pagemill's greedy /generate against transformers on the same weights.

Launches `pagemill launch --device cuda --dtype bfloat16 --attention NAME` on
the default model, sends a few greedy requests, stops the server, and then
scores every generated token under the Hugging Face model (bf16, CUDA,
teacher-forced on prompt + pagemill's tokens): each must be within --margin
of HF's best logit at its step. Two bf16 implementations round differently,
so near-ties may flip and exact greedy equality is too strict a test; a
broken attention kernel picks tokens far below the argmax. How many leading
tokens equal HF's own greedy continuation is reported too.

Run by scripts/gpu_check.sh (from benchmarks/); `--json PATH` writes the results.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

import _repo  # noqa: E402,F401  (the repository from this file's path)

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = [
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
    "The three primary colors are",
    "def fibonacci(n):",
    # Longer than several 16-token KV blocks, so attention spans block boundaries.
    "Once upon a time, in a small village at the edge of a great forest, there lived an old clockmaker "
    "who repaired every clock in the valley. One winter morning a stranger arrived with a broken watch and",
]


def logit_gaps(logits: torch.Tensor, tokens: list[int]) -> list[float]:
    """Best logit minus the chosen token's logit, per row (0 where the argmax was chosen)."""
    rows = torch.arange(len(tokens), device=logits.device)
    return (logits.max(-1).values - logits[rows, torch.tensor(tokens, device=logits.device)]).tolist()


@torch.no_grad()
def teacher_forced_logits(model, prompt_ids: list[int], generated: list[int]) -> torch.Tensor:
    """[len(generated), vocab] float logits; row j is the model's prediction for generated[j]."""
    device = next(model.parameters()).device
    logits = model(torch.tensor([prompt_ids + generated], device=device)).logits[0].float()
    return logits[len(prompt_ids) - 1 : len(prompt_ids) - 1 + len(generated)]


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@torch.no_grad()
def compare(model, tokenizer, prompt: str, generated: list[int], margin: float) -> dict:
    """Scores pagemill's tokens for one prompt under the HF model."""
    prompt_ids = tokenizer(prompt).input_ids
    gaps = logit_gaps(teacher_forced_logits(model, prompt_ids, generated), generated)
    ids = torch.tensor([prompt_ids], device=next(model.parameters()).device)
    ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=len(generated), do_sample=False,
                         pad_token_id=tokenizer.eos_token_id)[0, len(prompt_ids):].tolist()  # fmt: skip
    return {
        "prompt": prompt[:40],
        "tokens": len(generated),
        "max_logit_gap": max(gaps, default=0.0),
        "exact_prefix": common_prefix(generated, ref),
        "ok": all(g <= margin for g in gaps),
    }


def generate_all(model_dir: str, attention: str, device: str, dtype: str, max_new_tokens: int) -> list[list[int]]:
    import httpx

    sys.path.insert(0, str(ROOT / "integration-tests"))
    from server import launch

    # Half the GPU for the server's KV pool: the HF reference loads next to it.
    server = launch(model_dir, "--device", device, "--dtype", dtype, "--attention", attention,
                    "--gpu-memory-utilization", "0.5", timeout=150)  # fmt: skip
    try:
        backend = server.info()["attention_backend"]
        if backend != attention:
            raise RuntimeError(f"the server runs attention backend {backend!r}, not {attention!r}")
        out = []
        for prompt in PROMPTS:
            r = httpx.post(f"{server.url}/generate", timeout=60, json={
                "inputs": prompt, "parameters": {"max_new_tokens": max_new_tokens, "details": True}})  # fmt: skip
            r.raise_for_status()
            out.append([t["id"] for t in r.json()["details"]["tokens"]])
        return out
    finally:
        server.stop()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--attention", required=True, choices=["triton", "flash", "torch"])
    p.add_argument("--model", default=None, help="HF model dir (default: the converted default model)")
    p.add_argument("--device", default="cuda", help="cuda (cpu only to smoke-test this script)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--margin", type=float, default=0.5, help="allowed gap to HF's best logit (bf16 rounding)")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pagemill.models.default_model import ensure_default_model

    model_dir = str(a.model or ensure_default_model())
    generated = generate_all(model_dir, a.attention, a.device, a.dtype, a.max_new_tokens)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, a.dtype)).to(a.device).eval()
    rows = [compare(model, tokenizer, prompt, ids, a.margin) for prompt, ids in zip(PROMPTS, generated)]
    print(f"e2e attention={a.attention} device={a.device} dtype={a.dtype} margin={a.margin}")
    print(f"{'prompt':42} {'tokens':>6} {'max gap':>8} {'exact prefix':>12}  ok")
    for r in rows:
        print(f"{r['prompt']!r:42} {r['tokens']:>6} {r['max_logit_gap']:>8.3f} {r['exact_prefix']:>12}  {r['ok']}")
    if a.json:
        report = {"attention": a.attention, "device": a.device, "dtype": a.dtype, "margin": a.margin, "prompts": rows}
        Path(a.json).write_text(json.dumps(report, indent=2))
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
