"""Why quantized KV moves greedy output: each storage rounding alone, in process, on the default model.

    python benchmarks/kv_quant_variants.py --json benchmarks/results/kv_quant_variants.json

The model runs in float32 on the torch attention path (no compiled kernels,
so nothing but the pool's contents differs). Keys and values are rounded as
they are written, by one variant each, into a float32 pool that is read back
exactly: the difference to the unrounded run is the storage rounding alone.
Variants: bf16 (the natural noise floor: what a bf16 pool does to a float32
model), fp8 with the pool's scale of 1 (attention/kv_dtype.py), fp8 with a
scale per (token, kv head) (absmax / the format's max), and int8 with a
scale per (token, kv head) (what `--kv-cache-dtype int8` stores).

Same prompts and metrics as kv_quant_quality.py (passages of
benchmarks/texts/public_domain_en.txt, greedy continuations; identical,
agreement before the first divergence, |d logprob| of the chosen token there).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from kv_quant_quality import compare, prompts  # noqa: E402

from pagemill.attention import torch_backend  # noqa: E402
from pagemill.attention.kv_dtype import quantize_int8, widen  # noqa: E402
from pagemill.attention.metadata import make_metadata  # noqa: E402
from pagemill.models.default_model import ensure_default_model  # noqa: E402
from pagemill.models.loader import load_model  # noqa: E402
from pagemill.shard.kv_pool import KVPool  # noqa: E402

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def fp8_unscaled(dtype):
    limit = torch.finfo(dtype).max
    return lambda x: x.clamp(-limit, limit).to(dtype).float()


def fp8_per_row(dtype):
    limit = torch.finfo(dtype).max

    def f(x):
        s = x.abs().amax(-1, keepdim=True) / limit
        s = torch.where(s > 0, s, torch.ones_like(s))
        return (x / s).clamp(-limit, limit).to(dtype).float() * s

    return f


VARIANTS = {
    "fp32": lambda x: x,
    "bf16": lambda x: x.to(torch.bfloat16).float(),
    "fp8_e4m3": fp8_unscaled(E4M3),
    "fp8_e4m3 per row": fp8_per_row(E4M3),
    "fp8_e5m2": fp8_unscaled(E5M2),
    "fp8_e5m2 per row": fp8_per_row(E5M2),
    "int8 per row": lambda x: widen(quantize_int8(x), torch.float32),
}


@torch.inference_mode()
def greedy(model, pool, ids: list[int], max_new: int) -> dict:
    bs = pool.block_size
    table = list(range(1, 1 + -(-(len(ids) + max_new) // bs)))
    slot = lambda p: table[p // bs] * bs + p % bs  # noqa: E731
    n = len(ids)
    meta = make_metadata(is_prefill=True, query_lens=[n], kv_lens=[n], block_tables=[table],
                         slot_mapping=[slot(p) for p in range(n)], device="cpu")  # fmt: skip
    hidden = model(torch.tensor(ids), torch.arange(n), meta, pool.kv_caches)
    tokens, logprobs = [], []
    for p in range(n, n + max_new):
        lp = torch.log_softmax(model.compute_logits(hidden[-1:]).float()[0], -1)
        t = int(lp.argmax())
        tokens.append(t), logprobs.append(float(lp[t]))
        meta = make_metadata(is_prefill=False, query_lens=[1], kv_lens=[p + 1], block_tables=[table],
                             slot_mapping=[slot(p)], device="cpu")  # fmt: skip
        hidden = model(torch.tensor([t]), torch.tensor([p]), meta, pool.kv_caches)
    return {"tokens": tokens, "logprobs": logprobs}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-words", type=int, default=300)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    from tokenizers import Tokenizer

    model_dir = ensure_default_model()
    tok = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
    texts = [tok.encode(t).ids for t in prompts(args.prompts, args.prompt_words)]
    model, config = load_model(str(model_dir), "float32", cpu_kernels=False)
    longest = max(map(len, texts)) + args.max_tokens
    pool = KVPool.with_blocks(config, num_blocks=2 + -(-longest // 16), block_size=16, dtype=torch.float32,
                              device="cpu")  # fmt: skip
    write_rows = torch_backend.write_rows
    runs = []
    for name in args.variants.split(","):
        rnd = VARIANTS[name]
        torch_backend.write_rows = lambda rows, slots, x, rnd=rnd: write_rows(rows, slots, rnd(x.float()))
        t = time.perf_counter()
        outs = [greedy(model, pool, ids, args.max_tokens) for ids in texts]
        runs.append({"kv_cache_dtype": name, "blocks": 1.0, "outputs": outs})
        print(f"{name}: {time.perf_counter() - t:.0f} s", file=sys.stderr)
    torch_backend.write_rows = write_rows
    rows = [compare(runs[0], r) for r in runs]
    print("| KV rounding (float32 model) | identical | agreement | mean abs d logprob | max |")
    print("|---|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['kv_cache_dtype']} | {r['identical']}/{r['prompts']} | {r['agreement']:.3f} "
              f"| {r['mean_abs_dlogprob']:.4f} | {r['max_abs_dlogprob']:.4f} |")  # fmt: skip
    if args.json:
        for r in rows:
            del r["blocks"], r["capacity_x"]
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows, "runs": runs}, f, indent=1)


if __name__ == "__main__":
    main()
