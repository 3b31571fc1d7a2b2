"""The paged KV cache: one K and one V tensor per layer, cut into blocks.

The router owns block ids; the shard only holds the memory. Block 0 is
scratch: the router never hands it out, padding entries of block tables
point at it and warmup writes its dummy tokens into it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pagemill.attention.kv_dtype import row_width
from pagemill.models.config import ModelConfig
from pagemill.models.huge_pages import huge_zeros

SCRATCH_BLOCK = 0

# --block-size 0 (auto). On the CPU a decode step streams every running sequence's K and V
# from memory, block by block, and a block's rows are contiguous while blocks are scattered
# over the pool: measured end to end (benchmarks/paired_burst.py, 64 requests at once,
# default model, bf16), 64-token blocks served 1.06x the tok/s of 16-token ones (6 of 6
# pairs), 128-token blocks 0.99x 64-token ones. vLLM's CPU backend defaults to 128. The
# cost: prefixes are shared in whole blocks, and a sequence's last block is half empty on
# average. CUDA keeps 16 (its kernels gather keys one by one; docs/gpu.md).
CPU_BLOCK_SIZE = 64
CUDA_BLOCK_SIZE = 16


def resolve_block_size(block_size: int, device_type: str) -> int:
    """--block-size as given, or the device's default for 0; ValueError below 0."""
    if block_size < 0:
        raise ValueError(f"--block-size must be positive (or 0: the device's default), got {block_size}")
    if block_size:
        return block_size
    return CUDA_BLOCK_SIZE if device_type == "cuda" else CPU_BLOCK_SIZE


@dataclass
class KVPool:
    num_blocks: int
    block_size: int
    # [layers, 2, num_blocks, block_size, kv_heads, row_width]: one allocation,
    # per-layer views below (contiguous, so flat slot views are free). row_width:
    # head_dim, + 4 in an int8 pool, whose rows carry their scales (kv_dtype.py).
    storage: torch.Tensor
    # The per-layer views, made once per storage tensor: every forward reads them, and
    # slicing them anew cost ~50 us per decode step (30 layers).
    _views: tuple[torch.Tensor | None, list] = field(default=(None, []), init=False, repr=False, compare=False)

    @property
    def kv_caches(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        of, views = self._views
        if of is not self.storage:
            views = [(layer[0], layer[1]) for layer in self.storage]
            self._views = (self.storage, views)
        return views

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size

    @staticmethod
    def bytes_per_block(
        config: ModelConfig, block_size: int, dtype: torch.dtype, num_kv_heads: int | None = None
    ) -> int:
        """num_kv_heads: the heads this pool stores (a tensor-parallel rank's share; default all).
        Everything with_blocks allocates per block, int8's scales included."""
        kv_heads = config.num_key_value_heads if num_kv_heads is None else num_kv_heads
        per_token = 2 * config.num_hidden_layers * kv_heads * row_width(config.head_dim, dtype)
        return per_token * block_size * torch.empty((), dtype=dtype).element_size()

    @classmethod
    def allocate(
        cls,
        config: ModelConfig,
        *,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device | str,
        memory_bytes: int,
    ) -> "KVPool":
        """As many blocks as fit in memory_bytes (K and V of all layers together)."""
        per_block = cls.bytes_per_block(config, block_size, dtype)
        num_blocks = memory_bytes // per_block
        if num_blocks < 2:
            raise ValueError(
                f"KV cache budget of {memory_bytes} bytes holds {num_blocks} blocks of {per_block} bytes; "
                "need at least 2 (block 0 is scratch)"
            )
        return cls.with_blocks(config, num_blocks=num_blocks, block_size=block_size, dtype=dtype, device=device)

    @classmethod
    def with_blocks(
        cls, config: ModelConfig, *, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device | str,
        num_kv_heads: int | None = None, huge_pages: bool = False,
    ) -> "KVPool":
        shape = (
            config.num_hidden_layers,
            2,
            num_blocks,
            block_size,
            config.num_key_value_heads if num_kv_heads is None else num_kv_heads,
            row_width(config.head_dim, dtype),
        )
        # Zeros, not empty: decode multiplies masked (never written) slots by 0,
        # and 0 * NaN from uninitialised memory would poison the output.
        # huge_pages: a decode step reads blocks scattered over the pool; in 2 MiB pages far fewer of
        # those reads miss the TLB (models/huge_pages.py; measured ~10% faster paged attention).
        if huge_pages and torch.device(device).type == "cpu":
            storage = huge_zeros(shape, dtype)
        else:
            storage = torch.zeros(shape, dtype=dtype, device=device)
        return cls(num_blocks=num_blocks, block_size=block_size, storage=storage)
