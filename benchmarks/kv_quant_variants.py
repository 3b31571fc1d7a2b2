"""Why quantized KV moves greedy output: each storage rounding alone, in process, on the default model.

    python benchmarks/kv_quant_variants.py --json benchmarks/results/kv-quant-variants/kv_quant_variants.json

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

import _repo  # noqa: E402,F401  (the repository from this file's path)
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
def greedy(model, pool, texts: list[list[int]], max_new: int) -> list[dict]:
    """All prompts as one prefill, then batched greedy decode steps (one weight pass per step)."""
    bs, tables, nxt = pool.block_size, [], 1
    for ids in texts:
        n = -(-(len(ids) + max_new) // bs)
        tables.append(list(range(nxt, nxt + n)))
        nxt += n
    slot = lambda i, p: tables[i][p // bs] * bs + p % bs  # noqa: E731
    lens = [len(ids) for ids in texts]
    meta = make_metadata(is_prefill=True, query_lens=lens, kv_lens=lens, block_tables=tables,
                         slot_mapping=[slot(i, p) for i, n in enumerate(lens) for p in range(n)],
                         device="cpu")  # fmt: skip
    ids = torch.tensor([t for seq in texts for t in seq])
    positions = torch.tensor([p for n in lens for p in range(n)])
    hidden = model(ids, positions, meta, pool.kv_caches)
    last = hidden[torch.tensor(lens).cumsum(0) - 1]
    outs = [{"tokens": [], "logprobs": []} for _ in texts]
    for step in range(max_new):
        lp = torch.log_softmax(model.compute_logits(last).float(), -1)
        chosen = lp.argmax(-1)
        for i, o in enumerate(outs):
            o["tokens"].append(int(chosen[i])), o["logprobs"].append(float(lp[i, chosen[i]]))
        pos = [n + step for n in lens]
        meta = make_metadata(is_prefill=False, query_lens=[1] * len(texts), kv_lens=[p + 1 for p in pos],
                             block_tables=tables, slot_mapping=[slot(i, p) for i, p in enumerate(pos)],
                             device="cpu")  # fmt: skip
        last = model(chosen, torch.tensor(pos), meta, pool.kv_caches)
    return outs


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
    blocks = sum(-(-(len(ids) + args.max_tokens) // 16) for ids in texts)
    pool = KVPool.with_blocks(config, num_blocks=1 + blocks, block_size=16, dtype=torch.float32, device="cpu")
    write_rows = torch_backend.write_rows
    runs = []
    for name in args.variants.split(","):
        rnd = VARIANTS[name]
        torch_backend.write_rows = lambda rows, slots, x, rnd=rnd: write_rows(rows, slots, rnd(x.float()))
        t = time.perf_counter()
        outs = greedy(model, pool, texts, args.max_tokens)
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
