"""Baselines without a server, on the same model and machine: Hugging Face
`transformers` generate.

- static: fixed batches in arrival order (no sorting by length), left
  padding, one `generate` per batch that runs until its longest request is
  done (min_new_tokens = max_new_tokens = the batch's longest output, the
  equivalent of ignore_eos); every request counts only its own output
  length, the extra tokens are the waste of static batching.
- sequential: batch 1, one request after another, each exactly its length.

All requests are taken as arriving at t=0, so a request's E2E latency is
the time until its batch finished. Only token counts and times are kept.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import torch

from pagemill.bench.datasets import SampleRequest


@dataclass
class BaselineResult:
    name: str
    batch_size: int
    num_requests: int
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int  # useful tokens: each request's own output length
    computed_output_tokens: int  # what the batches actually generated (padding to the longest)
    output_throughput: float
    request_throughput: float
    mean_e2el_ms: float

    def to_dict(self) -> dict:
        return asdict(self)


def load_hf(model_dir: str, num_threads: int = 0):
    from transformers import AutoModelForCausalLM

    if num_threads:
        torch.set_num_threads(num_threads)
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@torch.inference_mode()
def hf_generate(model, tokenizer, requests: list[SampleRequest], batch_size: int, name: str,
                progress=None) -> BaselineResult:  # fmt: skip
    """Static batches of `batch_size` (batch_size=1: request by request)."""
    pad = model.generation_config.pad_token_id
    if pad is None:
        pad = model.config.eos_token_id if isinstance(model.config.eos_token_id, int) else 0
    start = time.perf_counter()
    ends, computed = [], 0
    for i in range(0, len(requests), batch_size):
        chunk = requests[i : i + batch_size]
        ids = [tokenizer.encode(r.prompt, add_special_tokens=False).ids for r in chunk]
        width = max(len(x) for x in ids)
        input_ids = torch.tensor([[pad] * (width - len(x)) + x for x in ids])  # left padding
        mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in ids])
        longest = max(r.output_len for r in chunk)
        out = model.generate(
            input_ids=input_ids, attention_mask=mask, max_new_tokens=longest, min_new_tokens=longest,
            do_sample=False, pad_token_id=pad,
        )  # fmt: skip
        computed += (out.shape[1] - width) * len(chunk)
        ends += [time.perf_counter() - start] * len(chunk)
        if progress is not None:
            for _ in chunk:
                progress.update()
    duration = time.perf_counter() - start
    useful = sum(r.output_len for r in requests)
    return BaselineResult(
        name=name, batch_size=batch_size, num_requests=len(requests), duration_s=duration,
        total_input_tokens=sum(r.prompt_len for r in requests), total_output_tokens=useful,
        computed_output_tokens=computed, output_throughput=useful / duration,
        request_throughput=len(requests) / duration, mean_e2el_ms=1000 * sum(ends) / len(ends),
    )  # fmt: skip
