"""Triton kernels of the `triton` attention backend (paged KV pool, packed tokens).

Every kernel reads the pool through block tables, so the pool layout
[num_blocks, block_size, kv_heads, head_dim] is never copied or reshaped.
Kernels are decorated when their module is first imported; with
TRITON_INTERPRET=1 set at that moment they run on CPU tensors (slowly).
"""

from pagemill.attention.kernels.decode import decode_partition_size, paged_decode
from pagemill.attention.kernels.kv_write import write_kv
from pagemill.attention.kernels.prefill import paged_prefill

__all__ = ["decode_partition_size", "paged_decode", "paged_prefill", "write_kv"]
