"""CPU weights and KV pool in transparent huge pages (2 MiB) where the kernel allows it.

Why: a batch-1 decode step streams every weight once (269 MB for the default
model in bf16). In 4 KiB pages that is 65,000 pages per step: each one a
TLB miss, and the hardware prefetchers stop at every page boundary. Linux's
default THP mode on servers is `madvise`, so memory gets huge pages only when
asked for. Measured on the default model (docs/cpu.md): the output head's
matrix-vector product ran at its memory floor only once its weight sat in
huge pages, and paged attention over a pool in huge pages ran ~10% faster.

torch's allocator can do this itself (THP_MEM_ALLOC_ENABLE), but only for
single allocations of 2 MiB or more, and most of a small model's weights are
smaller (the default model's q/k/v, o and down projections). So the weights
are moved into one arena instead: one allocation, advised before it is first
touched, each parameter a view into it. Elsewhere (no Linux, THP off) the
advice fails quietly and the arena is ordinary memory.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import sys

import torch
from torch import nn

log = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14  # <sys/mman.h> on Linux
_ALIGN = 64  # each tensor starts on a cache line


def _advise(addr: int, nbytes: int) -> bool:
    if not sys.platform.startswith("linux") or nbytes <= 0:
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        return libc.madvise(ctypes.c_void_p(addr), ctypes.c_size_t(nbytes), _MADV_HUGEPAGE) == 0
    except (OSError, AttributeError):
        return False


def huge_empty(nbytes: int) -> tuple[torch.Tensor, bool]:
    """An uninitialised CPU byte tensor of nbytes starting on a 2 MiB boundary, advised into
    huge pages before anything touches it; and whether the advice was taken."""
    base = torch.empty(nbytes + HUGE_PAGE, dtype=torch.uint8)
    skip = -base.data_ptr() % HUGE_PAGE
    buf = base[skip : skip + nbytes]  # a view: keeps `base` alive
    # Whole huge pages only: madvise wants a page-aligned length.
    return buf, _advise(buf.data_ptr(), (nbytes + HUGE_PAGE - 1) // HUGE_PAGE * HUGE_PAGE)


def huge_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """torch.zeros(shape, dtype) on the CPU, in huge pages where possible."""
    numel = 1
    for s in shape:
        numel *= s
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    buf, _ = huge_empty(max(nbytes, 1))
    return buf[:nbytes].view(dtype).view(shape).zero_()


def _round_up(n: int, to: int) -> int:
    return (n + to - 1) // to * to


def move_to_huge_pages(model: nn.Module) -> int:
    """Moves the model's CPU parameters and buffers into one huge-page arena, in module order
    (the order a forward pass reads them). Returns the bytes moved (0 when nothing is on the CPU).

    Call it before anything takes pointers into the weights (pack_weights: fused decode tables,
    packed copies). Tensors that share storage with another (tied or viewed weights) keep their
    storage, so ties are never broken; tied embeddings registered as one Parameter are moved once."""
    entries: list[tuple[nn.Module, str, torch.Tensor, bool]] = []  # owner, name, tensor, is_param
    seen: set[int] = set()
    storages: dict[int, int] = {}
    for owner in model.modules():
        for name, t in list(owner._parameters.items()) + list(owner._buffers.items()):
            if t is None or t.device.type != "cpu" or id(t) in seen:
                continue
            seen.add(id(t))
            key = t.untyped_storage().data_ptr()
            storages[key] = storages.get(key, 0) + 1
            entries.append((owner, name, t, name in owner._parameters))
    movable = [e for e in entries if storages[e[2].untyped_storage().data_ptr()] == 1 and e[2].is_contiguous()]
    views, total, advised = _into_arena([e[2] for e in movable])
    for (owner, name, t, is_param), view in zip(movable, views, strict=True):
        if is_param:
            t.data = view  # the same Parameter object: ties and optimizer-free references hold
        else:
            owner._buffers[name] = view
    if total:
        log.info("weights: %.0f MiB in one arena (%s)", total / 2**20,
                 "huge pages advised" if advised else "huge pages unavailable: plain pages")  # fmt: skip
    return total


def move_packed_to_huge_pages(model: nn.Module, attr: str = "packed") -> int:
    """Moves the plain CPU tensors that modules hold as `attr` (models/packed_linear.py's packed
    copies made after the weights' arena, such as gemm_bf16's) into an arena of their own. oneDNN's
    opaque copies stay where they are. Returns the bytes moved."""
    owners = [m for m in model.modules() if isinstance(getattr(m, attr, None), torch.Tensor)]
    owners = [m for m in owners if getattr(m, attr).layout == torch.strided and getattr(m, attr).device.type == "cpu"
              and not getattr(m, attr).is_mkldnn and getattr(m, attr).is_contiguous()]  # fmt: skip
    views, total, advised = _into_arena([getattr(m, attr) for m in owners])
    for m, view in zip(owners, views, strict=True):
        setattr(m, attr, view)
    if total:
        log.info("packed weight copies: %.0f MiB in one arena (%s)", total / 2**20,
                 "huge pages advised" if advised else "huge pages unavailable: plain pages")  # fmt: skip
    return total


def _into_arena(tensors: list[torch.Tensor]) -> tuple[list[torch.Tensor], int, bool]:
    """Copies of contiguous CPU tensors, in order, as views into one new huge-page arena; with
    the arena's bytes and whether the advice was taken."""
    total = sum(_round_up(t.numel() * t.element_size(), _ALIGN) for t in tensors)
    if total == 0:
        return [], 0, False
    arena, advised = huge_empty(total)
    views, offset = [], 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        view = arena[offset : offset + nbytes].view(t.dtype).view(t.shape)
        view.copy_(t)
        views.append(view)
        offset += _round_up(nbytes, _ALIGN)
    return views, total, advised
