"""Quality of `--quantize int8` against float32 and bfloat16 on the default model.

    python benchmarks/int8_quality.py [--model DIR] [--json out.json]

For each variant (float32; bfloat16; int8 with the rest of the model in float32 and in
bfloat16; int8 with the output head kept in float32; int8 without down_proj's Hadamard rotation):
- perplexity of benchmarks/texts/public_domain_en.txt (one prefill over the whole text);
- top-1 agreement with float32 on that text (teacher-forced: the same history for all);
- greedy agreement on a fixed prompt set: the tokens of 32-token greedy continuations equal to
  float32's, up to the first divergence (mean share) and whole continuations identical.
Prints a table and writes JSON. Deterministic: no sampling, fixed inputs.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import _repo  # noqa: E402,F401  (the repository from this file's path)
from pagemill.attention.metadata import make_metadata
from pagemill.models.loader import load_model
from pagemill.models.quantized_linear import quantize_model
from pagemill.shard.kv_pool import KVPool

TEXT = Path(__file__).parent / "texts" / "public_domain_en.txt"
PROMPTS = [
    "The capital of France is",
    "Write a short poem about the sea.",
    "Explain in one sentence why the sky is blue.",
    "def fibonacci(n):",
    "The three primary colors are",
    "Once upon a time, in a small village,",
    "List three uses of a paperclip:",
    "What is 12 times 13?",
]
NEW_TOKENS = 32
BLOCK = 16

# name -> (model dtype, quantize, output head quantized, down_proj Hadamard-rotated)
VARIANTS = {
    "float32": ("float32", False, False, False),
    "bfloat16": ("bfloat16", False, False, False),
    "int8 (rest float32)": ("float32", True, True, True),
    "int8 (rest bfloat16)": ("bfloat16", True, True, True),
    "int8, float32 head": ("float32", True, False, True),
    "int8, no rotation": ("float32", True, True, False),
}


class Sequence:
    """One sequence in its own pool: prefill, then decode steps (contiguous blocks)."""

    def __init__(self, model, config, dtype: torch.dtype, max_len: int) -> None:
        self.model = model
        blocks = max_len // BLOCK + 2
        self.pool = KVPool.with_blocks(config, num_blocks=blocks, block_size=BLOCK, dtype=dtype, device="cpu")
        self.table = list(range(1, blocks))
        self.len = 0

    @torch.no_grad()
    def step(self, ids: list[int]) -> torch.Tensor:
        """Feeds `ids` after the cached tokens; float32 logits [len(ids), vocab]."""
        n, start = len(ids), self.len
        self.len += n
        slots = [self.table[p // BLOCK] * BLOCK + p % BLOCK for p in range(start, self.len)]
        meta = make_metadata(is_prefill=start == 0 or n > 1, query_lens=[n], kv_lens=[self.len],
                             block_tables=[self.table], slot_mapping=slots, device="cpu")  # fmt: skip
        hidden = self.model(torch.tensor(ids), torch.arange(start, self.len), meta, self.pool.kv_caches)
        return self.model.compute_logits(hidden)


def load(model_dir: str, dtype: str, quantize: bool, head: bool, rotate: bool):
    model, config = load_model(model_dir, dtype, "cpu")
    if quantize:
        quantize_model(model, lm_head=head, rotate_down=rotate)
        model.pack_weights()  # what load_model does after quantizing (fused decode off: int8 weights)
    return model, config


def greedy(model, config, dtype, prompt: list[int]) -> list[int]:
    seq = Sequence(model, config, dtype, len(prompt) + NEW_TOKENS)
    logits = seq.step(prompt)
    out = [int(logits[-1].argmax())]
    for _ in range(NEW_TOKENS - 1):
        out.append(int(seq.step([out[-1]])[-1].argmax()))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="HF model dir (default: SmolLM2-135M-Instruct, converted once)")
    p.add_argument("--json", default=_repo.results("int8-quality", "int8_quality.json"))
    a = p.parse_args()
    from pagemill.bench.cli import resolve_model_dir
    from tokenizers import Tokenizer

    model_dir = resolve_model_dir(a.model)
    tok = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
    text_ids = tok.encode(TEXT.read_text()).ids
    prompt_ids = [tok.encode(s).ids for s in PROMPTS]
    rows, ref_top1, ref_greedy = [], None, None
    for name, (dtype, quantize, head, rotate) in VARIANTS.items():
        t0 = time.perf_counter()
        model, config = load(model_dir, dtype, quantize, head, rotate)
        tdtype = getattr(torch, dtype)
        logits = Sequence(model, config, tdtype, len(text_ids)).step(text_ids)
        nll = F.cross_entropy(logits[:-1], torch.tensor(text_ids[1:])).item()
        top1 = logits[:-1].argmax(-1)
        outs = [greedy(model, config, tdtype, ids) for ids in prompt_ids]
        if ref_top1 is None:
            ref_top1, ref_greedy = top1, outs
        prefix = [next((i for i, (x, y) in enumerate(zip(o, r)) if x != y), NEW_TOKENS) / NEW_TOKENS
                  for o, r in zip(outs, ref_greedy)]  # fmt: skip
        row = {
            "variant": name, "dtype": dtype, "quantize": "int8" if quantize else None, "int8_head": head,
            "rotate_down": rotate,
            "perplexity": math.exp(nll), "top1_agree_vs_fp32": (top1 == ref_top1).float().mean().item(),
            "greedy_prefix_agree_vs_fp32": sum(prefix) / len(prefix),
            "greedy_identical_vs_fp32": sum(o == r for o, r in zip(outs, ref_greedy)),
            "seconds": time.perf_counter() - t0,
        }  # fmt: skip
        rows.append(row)
        print(f"{name:22s} ppl {row['perplexity']:8.3f}  top1 {row['top1_agree_vs_fp32']:.3f}  "
              f"greedy prefix {row['greedy_prefix_agree_vs_fp32']:.3f}  identical "
              f"{row['greedy_identical_vs_fp32']}/{len(PROMPTS)}", flush=True)  # fmt: skip
        del model
    print()
    print(f"text: {TEXT.name}, {len(text_ids)} tokens; {len(PROMPTS)} prompts x {NEW_TOKENS} greedy tokens")
    print("| variant | perplexity | top-1 agreement vs fp32 | greedy prefix agreement | identical continuations |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(f"| {r['variant']} | {r['perplexity']:.3f} | {r['top1_agree_vs_fp32']:.3f} | "
              f"{r['greedy_prefix_agree_vs_fp32']:.3f} | {r['greedy_identical_vs_fp32']}/{len(PROMPTS)} |")  # fmt: skip
    out = {"model_dir": model_dir, "text": TEXT.name, "text_tokens": len(text_ids), "prompts": PROMPTS,
           "new_tokens": NEW_TOKENS, "cpu_flags": cpu_flags(), "machine": platform.processor(),
           "rows": rows}  # fmt: skip
    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    Path(a.json).write_text(json.dumps(out, indent=1))
    print(f"wrote {a.json}")


def cpu_flags() -> list[str]:
    """The flags the kernels' paths depend on."""
    try:
        line = next(x for x in Path("/proc/cpuinfo").read_text().splitlines() if x.startswith("flags"))
    except (OSError, StopIteration):
        return []
    return sorted(f for f in line.split(":")[1].split() if f.startswith(("avx512", "amx", "avx_vnni", "avx2")))


if __name__ == "__main__":
    main()
