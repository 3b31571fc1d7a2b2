"""Triton kernels of the `triton` attention backend (paged KV pool, packed tokens).

Every kernel reads the pool through block tables, so the pool layout
[num_blocks, block_size, kv_heads, head_dim] is never copied or reshaped.
With TRITON_INTERPRET=1 set before triton is first imported (and kept set)
they run in Triton's interpreter on CPU tensors, slowly: for tests and debugging.
"""

from pagemill.attention.kernels.decode import decode_partition_size, paged_decode
from pagemill.attention.kernels.kv_write import write_kv
from pagemill.attention.kernels.prefill import paged_prefill

__all__ = ["decode_partition_size", "paged_decode", "paged_prefill", "write_kv"]
