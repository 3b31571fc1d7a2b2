"""Writes tests/data/gguf_reference.json: what transformers' GGUF loader (float32, dequantized
with gguf-py) computes on the real GGUF files tests/test_gguf_real.py serves kept quantized.

Per file and prompt: the prompt's ids (transformers' GGUF tokenizer), 16 greedy tokens (a
fixed count: an end-of-sequence token does not stop it) and the first step's top-5 logits.
Stored because loading the 262144-token Gemma 3 file through transformers takes minutes
(its GGUFReader parses the vocabulary element by element); rerun after changing a file:

    PYTHONPATH=server python3 tests/gguf_reference.py
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import torch
import transformers

OUT = Path(__file__).parent / "data" / "gguf_reference.json"
GEMMA = Path("/work/peers/models/gemma-3-270m-q4_k_m.gguf")
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]
STEPS = 16


def real_files() -> dict[str, Path]:
    from pagemill.models.default_model import find_default_gguf

    return {"gemma-3-270m-q4_k_m": GEMMA, "smollm2-135m-instruct-q4_1": find_default_gguf()}


def fingerprint(path: Path) -> dict:
    """Size and a hash of the first MiB (header and metadata): enough to tell a different file."""
    with open(path, "rb") as f:
        head = hashlib.sha256(f.read(1 << 20)).hexdigest()
    return {"size": path.stat().st_size, "sha256_first_mib": head}


@torch.no_grad()
def reference(path: Path) -> dict:
    tok = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32,
                                                              attn_implementation="eager").eval()  # fmt: skip
    prompts = []
    for text in PROMPTS:
        ids = tok(text).input_ids
        seq, first = list(ids), None
        for _ in range(STEPS):
            logits = model(torch.tensor([seq])).logits[0, -1].float()
            if first is None:
                first = logits.topk(5)
            seq.append(int(logits.argmax()))
        prompts.append({"text": text, "ids": ids, "greedy": seq[len(ids):], "top5_ids": first.indices.tolist(),
                        "top5_logits": first.values.tolist()})  # fmt: skip
    return {**fingerprint(path), "prompts": prompts}


def main() -> None:
    names = sys.argv[1:] or list(real_files())
    data = json.loads(OUT.read_text()) if OUT.is_file() else {}
    data["transformers"] = transformers.__version__
    for name in names:
        data[name] = reference(real_files()[name])
        print(name, [p["greedy"] for p in data[name]["prompts"]], flush=True)
    OUT.parent.mkdir(exist_ok=True)
    OUT.write_text(json.dumps(data, indent=1) + "\n")


if __name__ == "__main__":
    main()
