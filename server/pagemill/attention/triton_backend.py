"""The `triton` backend: our own paged-attention kernels (attention/kernels/)."""

from __future__ import annotations

import torch

from pagemill.attention.kernels import decode_partition_size, paged_decode, paged_prefill, write_kv
from pagemill.attention.metadata import AttentionMetadata


class TritonAttentionBackend:
    name = "triton"

    def __init__(self, device: torch.device | str) -> None:
        device = torch.device(device)
        # The split-K heuristic sizes decode grids against the SM count. Under
        # the CPU interpreter programs run one after another: never split there.
        self.num_sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1

    def write_kv(self, k, v, k_cache, v_cache, slot_mapping) -> None:
        write_kv(k, v, k_cache, v_cache, slot_mapping)

    def prefill(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float,
                window: int | None = None, softcap: float | None = None) -> torch.Tensor:  # fmt: skip
        # k/v are already in the pool (write_kv ran first): the kernel reads them from there.
        return paged_prefill(
            q, k_cache, v_cache, meta.block_tables, meta.cu_seqlens_q, meta.context_lens, meta.max_seqlen_q, scale,
            window, softcap,
        )

    def decode(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float,
               window: int | None = None, softcap: float | None = None) -> torch.Tensor:  # fmt: skip
        partition = decode_partition_size(meta.num_seqs, k_cache.shape[2], meta.max_seqlen_k, self.num_sms)
        return paged_decode(
            q, k_cache, v_cache, meta.block_tables, meta.context_lens, meta.max_seqlen_k, scale, partition,
            window, softcap,
        )
