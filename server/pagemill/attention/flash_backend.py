"""The `flash` backend: FlashAttention-2 (the `flash-attn` package) over the paged pool.

flash-attn reads a paged cache only when the pool's block size is a multiple
of 256 (flash_api.cpp checks it in both varlen_fwd and fwd_kvcache) and
only in fp16/bf16. Then prefill is flash_attn_varlen_func with block_table
(causal aligned bottom-right, which is exactly "new token j sees the cached
prefix plus new tokens 0..j") and decode is flash_attn_with_kvcache with
block_table and cache_seqlens. With smaller blocks (the default is 16) a
fresh prompt still goes through flash_attn_varlen_func on the packed k/v,
which hold all of its keys, while cached-prefix prefill and decode run on
the Triton kernels; float32 runs entirely on Triton. Each such fallback is
logged once. The KV write is always the Triton kernel: flash-attn has no
scatter to arbitrary slots. flash-attn 2 has no fp8 cache either: with an
fp8 pool (kv_dtype.py) only fresh prompts run on flash-attn.

A sliding-window layer passes window_size=(window - 1, 0): flash-attn's
left bound counts keys before the query, ours counts the query itself
(transformers: key > query - window). Gemma 2's logit cap is its `softcap`.
"""

from __future__ import annotations

import logging

import torch

from pagemill.attention.backend import AttentionBackend
from pagemill.attention.kv_dtype import is_fp8, kv_dtype_name
from pagemill.attention.metadata import AttentionMetadata

log = logging.getLogger(__name__)

PAGED_BLOCK_MULTIPLE = 256
FLASH_DTYPES = (torch.float16, torch.bfloat16)


class FlashAttentionBackend:
    name = "flash"

    def __init__(self, flash_attn, fallback: AttentionBackend) -> None:
        """flash_attn: the imported module (or anything with its two functions)."""
        self.fa = flash_attn
        self.fallback = fallback
        self._noted: set[str] = set()

    def _note(self, what: str) -> None:
        if what not in self._noted:
            self._noted.add(what)
            log.warning("flash attention backend: %s run on the %s kernels", what, self.fallback.name)

    def _flash_dtype(self, q: torch.Tensor) -> bool:
        if q.dtype in FLASH_DTYPES:
            return True
        self._note(f"flash-attn has no {q.dtype} kernels: all attention steps")
        return False

    def _small_blocks(self, k_cache: torch.Tensor, what: str) -> None:
        self._note(f"KV blocks of {k_cache.shape[1]} tokens (flash-attn pages by multiples of "
                   f"{PAGED_BLOCK_MULTIPLE}): {what}")  # fmt: skip

    def _fp8_pool(self, k_cache: torch.Tensor, what: str) -> bool:
        # flash-attn 2 reads fp16/bf16 caches only; fresh prompts still use it on their packed k/v.
        if not is_fp8(k_cache.dtype):
            return False
        self._note(f"flash-attn 2 has no fp8 KV cache ({kv_dtype_name(k_cache.dtype)}): {what}")
        return True

    def write_kv(self, k, v, k_cache, v_cache, slot_mapping) -> None:
        self.fallback.write_kv(k, v, k_cache, v_cache, slot_mapping)

    def prefill(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float,
                window: int | None = None, softcap: float | None = None) -> torch.Tensor:  # fmt: skip
        if not self._flash_dtype(q):
            return self.fallback.prefill(q, k, v, k_cache, v_cache, meta, scale, window, softcap)
        options = _options(scale, window, softcap)
        paged = k_cache.shape[1] % PAGED_BLOCK_MULTIPLE == 0
        if paged and not self._fp8_pool(k_cache, "prefills with a cached prefix"):
            return self.fa.flash_attn_varlen_func(
                q, k_cache, v_cache, meta.cu_seqlens_q, meta.cu_seqlens_k, meta.max_seqlen_q, meta.max_seqlen_k,
                block_table=meta.block_tables, **options,
            )  # fmt: skip
        if meta.query_lens == meta.kv_lens:  # nothing cached: the packed k/v are every key
            return self.fa.flash_attn_varlen_func(
                q, k, v, meta.cu_seqlens_q, meta.cu_seqlens_q, meta.max_seqlen_q, meta.max_seqlen_q, **options,
            )  # fmt: skip
        if not paged:  # (an fp8 pool with paged blocks was noted above)
            self._small_blocks(k_cache, "prefills with a cached prefix")
        return self.fallback.prefill(q, k, v, k_cache, v_cache, meta, scale, window, softcap)

    def decode(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float,
               window: int | None = None, softcap: float | None = None) -> torch.Tensor:  # fmt: skip
        if not self._flash_dtype(q):
            return self.fallback.decode(q, k_cache, v_cache, meta, scale, window, softcap)
        if self._fp8_pool(k_cache, "decode steps"):
            return self.fallback.decode(q, k_cache, v_cache, meta, scale, window, softcap)
        if k_cache.shape[1] % PAGED_BLOCK_MULTIPLE == 0:
            out = self.fa.flash_attn_with_kvcache(
                q.unsqueeze(1), k_cache, v_cache, cache_seqlens=meta.context_lens, block_table=meta.block_tables,
                **_options(scale, window, softcap),
            )  # fmt: skip
            return out.squeeze(1)
        self._small_blocks(k_cache, "decode steps")
        return self.fallback.decode(q, k_cache, v_cache, meta, scale, window, softcap)


def _options(scale: float, window: int | None, softcap: float | None) -> dict:
    """flash-attn's keyword arguments for a causal layer with this window and logit cap."""
    options = dict(softmax_scale=scale, causal=True)
    if window is not None:
        options["window_size"] = (window - 1, 0)
    if softcap is not None:
        options["softcap"] = softcap
    return options
