"""Lower bounds on the time of a whole workload, continuous vs static batching.

The per-step roofline (roofline.py) applied to every step a schedule must
run. All requests arrive at t=0 (the suite's main workload), so:

- continuous batching (pagemill): every prompt is prefilled once (layers
  for every prompt token, the output head for the last one only); then
  decode step s runs the requests whose output is longer than s, each
  request computing exactly its own output length;
- static batching (transformers `generate`): batches of B in arrival order,
  each prefilled padded to its longest prompt (the head for the last row of
  each sequence only: the floor ignores that HF computes it for all rows), then
  running max(output) steps at full batch B.

A step costs max(bytes / bandwidth, FLOPs / matmul rate). Attention FLOPs and
KV bytes are counted with each sequence's true context. The bound ignores
everything but weights, KV and matmul arithmetic, so no implementation on
the machine can beat it; the ratio of the two bounds is the most continuous
batching can gain over a static baseline that ran at its own floor.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Sequence

from pagemill.bench.roofline import Machine
from pagemill.models.config import ModelConfig


@dataclass
class WorkloadFloor:
    prefill_s: float
    decode_s: float
    total_s: float
    output_tokens: int  # tokens the requests asked for
    computed_tokens: int  # decode tokens the schedule computes (padding included)
    throughput_ceiling: float  # output_tokens / total_s


class _Cost:
    def __init__(self, cfg: ModelConfig, m: Machine, dtype_bytes: float = 4) -> None:
        h, i, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
        q, kv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
        self.layer_params = cfg.num_hidden_layers * (h * (q + 2 * kv) + q * h + 3 * h * i)
        self.head_params = cfg.vocab_size * h
        self.kv_per_token = 2 * cfg.num_hidden_layers * kv * dtype_bytes
        self.attn_per_pair = 4 * cfg.num_attention_heads * d * cfg.num_hidden_layers  # q.k and p.v, per key
        self.dtype_bytes = dtype_bytes
        self.bw, self.rate = m.bandwidth_gbs * 1e9, m.matmul_gflops * 1e9

    def step(self, layer_rows: int, head_rows: int, kv_tokens: int, attn_pairs: int) -> float:
        weights = (self.layer_params + self.head_params) * self.dtype_bytes
        flops = 2.0 * (self.layer_params * layer_rows + self.head_params * head_rows) + self.attn_per_pair * attn_pairs
        return max((weights + kv_tokens * self.kv_per_token) / self.bw, flops / self.rate)


def continuous_floor(cfg: ModelConfig, m: Machine, prompt_lens: Sequence[int],
                     output_lens: Sequence[int], dtype_bytes: float = 4) -> WorkloadFloor:  # fmt: skip
    """dtype_bytes: bytes per weight and KV entry (m.matmul_gflops should be that dtype's rate)."""
    c = _Cost(cfg, m, dtype_bytes)
    # Prefill in one pass: weights read once, causal attention within each prompt.
    prefill = c.step(sum(prompt_lens), len(prompt_lens), sum(prompt_lens), sum(p * (p + 1) // 2 for p in prompt_lens))
    decode, computed = 0.0, 0
    # The first token comes from the prefill; decode step s feeds token s.
    for s in range(1, max(output_lens, default=1)):
        alive = [(p, o) for p, o in zip(prompt_lens, output_lens) if o > s]
        ctx = sum(p + s for p, _ in alive)
        decode += c.step(len(alive), len(alive), ctx, ctx)
        computed += len(alive)
    total = prefill + decode
    return WorkloadFloor(prefill, decode, total, sum(output_lens), computed + len(prompt_lens),
                         sum(output_lens) / total)  # fmt: skip


def static_floor(cfg: ModelConfig, m: Machine, prompt_lens: Sequence[int], output_lens: Sequence[int],
                 batch_size: int) -> WorkloadFloor:  # fmt: skip
    c = _Cost(cfg, m)
    prefill = decode = 0.0
    computed = 0
    for start in range(0, len(prompt_lens), batch_size):
        ps, os_ = prompt_lens[start : start + batch_size], output_lens[start : start + batch_size]
        b, p, steps = len(ps), max(ps), max(os_)
        prefill += c.step(b * p, b, b * p, b * p * (p + 1) // 2)
        for s in range(1, steps):
            decode += c.step(b, b, b * (p + s), b * (p + s))
        computed += b * steps
    total = prefill + decode
    return WorkloadFloor(prefill, decode, total, sum(output_lens), computed, sum(output_lens) / total)


def bound_report(cfg: ModelConfig, m: Machine, prompt_lens, output_lens, batch_size: int,
                 static_measured_tok_s: float | None = None) -> dict:  # fmt: skip
    """Both floors, and the highest ratio over the measured static baseline
    that continuous batching could reach on this machine."""
    cont, stat = continuous_floor(cfg, m, prompt_lens, output_lens), static_floor(cfg, m, prompt_lens,
                                                                                 output_lens, batch_size)  # fmt: skip
    out = {"machine": asdict(m), "continuous": asdict(cont), f"static_b{batch_size}": asdict(stat),
           "ceiling_ratio_vs_static_floor": cont.throughput_ceiling / stat.throughput_ceiling}  # fmt: skip
    if static_measured_tok_s:
        out["static_measured_tok_s"] = static_measured_tok_s
        out["ceiling_ratio_vs_static_measured"] = cont.throughput_ceiling / static_measured_tok_s
    return out
