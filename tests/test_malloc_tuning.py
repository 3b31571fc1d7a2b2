"""shard/malloc_tuning.py: after keep_freed_memory, a step's large tensors reuse their pages."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

# A child process, so the test process keeps its own malloc settings. Each round allocates
# and writes three 12 MB tensors (as a step's activations), then frees them. Under glibc's
# defaults some runs fault every round's pages in again (the freed top of the heap is trimmed
# above twice the largest block it mapped on its own) and some do not, so only the kept case
# is asserted. Printed: the minor page faults of rounds 7-12 and the pages those rounds wrote;
# the first rounds grow the heap either way.
PROBE = textwrap.dedent("""
    import resource, sys, torch
    from pagemill.shard.malloc_tuning import keep_freed_memory
    if sys.argv[1] == "keep":
        assert keep_freed_memory()
    def round_():
        ts = [torch.empty(12 << 20, dtype=torch.uint8).fill_(1) for _ in range(3)]
        del ts
    for _ in range(6):
        round_()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(6):
        round_()
    print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before, 6 * 3 * (12 << 20) // 4096)
""")


def probe(mode: str) -> tuple[int, int]:
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    faults, pages = out.stdout.split()
    return int(faults), int(pages)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_freed_step_memory_is_reused_without_new_page_faults():
    faults, pages = probe("keep")
    assert faults < pages // 50, f"{faults} page faults for {pages} pages written again"


# glibc marks a chunk it mapped on its own with bit 1 of the size word before it.
MAPPED = textwrap.dedent("""
    import ctypes, sys
    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    if sys.argv[1] == "keep":
        from pagemill.shard.malloc_tuning import keep_freed_memory
        assert keep_freed_memory()
    p = libc.malloc(16 << 20)
    print(ctypes.c_size_t.from_address(p - 8).value & 2)
    libc.free(p)
""")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_a_16_mb_block_comes_from_the_heap_not_its_own_mapping():
    # The defaults map it on its own (and unmap it when freed); after keep_freed_memory the heap
    # serves it, so the memory stays with the process for the next step.
    def mapped(mode: str) -> bool:
        out = subprocess.run([sys.executable, "-c", MAPPED, mode], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        return out.stdout.strip() != "0"

    assert mapped("default")
    assert not mapped("keep")
