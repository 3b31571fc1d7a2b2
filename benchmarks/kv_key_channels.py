"""Key/value outlier channels of the default model (float32, one 300-word passage): row absmax / rms,
largest channel vs median channel, and the int8 rms error with a scale per row vs per channel.

    python benchmarks/kv_key_channels.py [--words 300]

Prints the figures (docs/kv_cache.md cites them); writes nothing.
"""

from __future__ import annotations

import argparse

import torch

import _repo  # noqa: F401  (the repository from this file's path)


def capture_kv(words: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Every layer's new keys and values [T, kv_heads, head_dim] of one prefill of a passage."""
    from tokenizers import Tokenizer

    from kv_quant_quality import prompts
    from pagemill.attention import torch_backend
    from pagemill.attention.metadata import make_metadata
    from pagemill.models.default_model import ensure_default_model
    from pagemill.models.loader import load_model
    from pagemill.shard.kv_pool import KVPool

    d = ensure_default_model()
    ids = Tokenizer.from_file(str(d / "tokenizer.json")).encode(prompts(1, words)[0]).ids
    model, cfg = load_model(str(d), "float32", cpu_kernels=False)
    n = len(ids)
    pool = KVPool.with_blocks(cfg, num_blocks=2 + n // 16, block_size=16, dtype=torch.float32, device="cpu")
    seen = []
    orig = torch_backend.write_rows

    def capture(rows, slots, x):
        seen.append(x.clone())
        orig(rows, slots, x)

    table = list(range(1, 2 + n // 16))
    slots = [table[p // 16] * 16 + p % 16 for p in range(n)]
    meta = make_metadata(is_prefill=True, query_lens=[n], kv_lens=[n], block_tables=[table], slot_mapping=slots,
                         device="cpu")  # fmt: skip
    torch_backend.write_rows = capture
    try:
        with torch.inference_mode():
            model(torch.tensor(ids), torch.arange(n), meta, pool.kv_caches)
    finally:
        torch_backend.write_rows = orig
    return seen[0::2], seen[1::2]


def stats(xs: list[torch.Tensor], name: str) -> None:
    x = torch.stack(xs)  # layers, T, kvh, D
    ratio = x.abs().amax(-1) / x.pow(2).mean(-1).sqrt()
    ch = x.abs().mean(1)  # layers, kvh, D: mean |x| per channel
    chr_ = ch.amax(-1) / ch.median(-1).values
    print(f"{name}: row absmax/rms median {ratio.median():.1f} p90 {ratio.quantile(0.9):.1f}; per (layer, head) "
          f"max channel mean|x| / median channel: median {chr_.median():.1f} max {chr_.max():.1f}")  # fmt: skip
    # int8 per-row vs per-channel (over tokens) error
    s_row = x.abs().amax(-1, keepdim=True) / 127
    e_row = ((x / s_row).round() * s_row - x).pow(2).mean().sqrt()
    s_ch = x.abs().amax(1, keepdim=True) / 127
    e_ch = ((x / s_ch).round() * s_ch - x).pow(2).mean().sqrt()
    print(f"   int8 rms error per-row scale {e_row:.4f}, per-channel scale {e_ch:.4f}, "
          f"rms |x| {x.pow(2).mean().sqrt():.3f}")  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--words", type=int, default=300, help="words of the passage prefilled")
    a = p.parse_args()
    ks, vs = capture_kv(a.words)
    stats(ks, "K")
    stats(vs, "V")


if __name__ == "__main__":
    main()
