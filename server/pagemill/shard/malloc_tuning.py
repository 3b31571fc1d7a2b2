"""glibc's malloc told to keep freed memory mapped, so each step's large tensors reuse pages.

Why: a step allocates its activations afresh (a 2048-token prefill's linears write
several MB each). glibc serves blocks that large with mmap, or trims them off its heap
when freed, so every step touched new pages: measured on a 2044-token prefill step of
the default model (perf, 2 threads), 46,000 page faults, ~11% of the step the kernel
zeroing and mapping pages under the GEMM's first stores; the step took 369-428 ms against
335-346 ms with the thresholds below (docs/cpu.md, "Freed step memory kept"). Blocks above MMAP_THRESHOLD (the KV pool, the weights) are still
mapped on their own, so only a step's transient memory stays with the process.
"""

from __future__ import annotations

import ctypes
import logging

log = logging.getLogger("pagemill.shard")

# mallopt's parameter numbers (malloc.h).
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3

# glibc's largest mmap threshold on 64-bit (HEAP_MAX_SIZE / 2): blocks up to it come from
# the heap and are reused there.
MMAP_THRESHOLD = 32 << 20
# Free memory at the heap's top kept rather than returned to the system.
TRIM_THRESHOLD = 1 << 30


def keep_freed_memory(mmap_threshold: int = MMAP_THRESHOLD, trim_threshold: int = TRIM_THRESHOLD) -> bool:
    """Sets the process's malloc thresholds; False where the C library has no mallopt
    (musl, macOS) or refuses a value, which leaves its defaults."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    ok = mallopt(M_MMAP_THRESHOLD, mmap_threshold) == 1 and mallopt(M_TRIM_THRESHOLD, trim_threshold) == 1
    if not ok:
        log.warning("mallopt refused the thresholds; freed step memory goes back to the system")
    return ok
