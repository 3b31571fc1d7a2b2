"""GGUF blocks -> float32 values in torch, for every type in types.SUPPORTED_TYPES.

Vectorized over all blocks at once and on any device. Each type repeats gguf-py's numpy
reference (gguf.quants) operation for operation in float32, so the values are bit-identical
to what transformers' GGUF loader (which calls gguf.quants.dequantize) produces; the tests
check that for every type.
"""

from __future__ import annotations

from typing import Callable

import torch

from pagemill.models.gguf.types import (
    ALL_TYPES, BF16, F16, F32, Q2_K, Q3_K, Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K, Q8_0, GGUFError,
)  # fmt: skip


def _f16(b: torch.Tensor) -> torch.Tensor:
    """[n, 2] bytes -> float32 [n, 1] (little-endian half floats)."""
    return b.contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor, groups: int) -> torch.Tensor:
    """[n, groups * w] bytes -> [n, groups, 2, w]: each group's low nibbles, then its high ones."""
    q = qs.reshape(qs.shape[0], groups, 1, -1)
    return torch.cat([q & 0x0F, q >> 4], dim=2)


def _bits(b: torch.Tensor, n: int, width: int) -> torch.Tensor:
    """[m, w] bytes -> [m, n, w]: field i (of `width` bits) of each byte, i = 0..n-1."""
    shifts = torch.arange(0, n * width, width, dtype=torch.uint8, device=b.device)
    return (b[:, None, :] >> shifts[None, :, None]) & ((1 << width) - 1)


def _q4_0(b: torch.Tensor) -> torch.Tensor:
    d = _f16(b[:, :2])
    q = _nibbles(b[:, 2:], 1).reshape(b.shape[0], 32).to(torch.int8) - 8
    return d * q.float()


def _q4_1(b: torch.Tensor) -> torch.Tensor:
    d, m = _f16(b[:, :2]), _f16(b[:, 2:4])
    q = _nibbles(b[:, 4:], 1).reshape(b.shape[0], 32).float()
    return d * q + m


def _q5_high(qh: torch.Tensor) -> torch.Tensor:
    """[n, 4] bytes (a little-endian uint32) -> [n, 32] bits 0..31."""
    return _bits(qh, 8, 1).permute(0, 2, 1).reshape(qh.shape[0], 32)


def _q5_0(b: torch.Tensor) -> torch.Tensor:
    d = _f16(b[:, :2])
    low = _nibbles(b[:, 6:], 1).reshape(b.shape[0], 32)
    q = (low | (_q5_high(b[:, 2:6]) << 4)).to(torch.int8) - 16
    return d * q.float()


def _q5_1(b: torch.Tensor) -> torch.Tensor:
    d, m = _f16(b[:, :2]), _f16(b[:, 2:4])
    low = _nibbles(b[:, 8:], 1).reshape(b.shape[0], 32)
    q = (low | (_q5_high(b[:, 4:8]) << 4)).float()
    return d * q + m


def _q8_0(b: torch.Tensor) -> torch.Tensor:
    return b[:, 2:].contiguous().view(torch.int8).float() * _f16(b[:, :2])


def _scale_min_k4(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K's 12 bytes of packed 6-bit scales and mins -> ([n, 8], [n, 8]) as float32."""
    s = s.reshape(-1, 3, 4)
    d, m, md = s[:, 0], s[:, 1], s[:, 2]
    sc = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=1)
    mn = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=1)
    return sc.float(), mn.float()


def _q4_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    d, dmin = _f16(b[:, :2]), _f16(b[:, 2:4])
    sc, mn = _scale_min_k4(b[:, 4:16])
    q = _nibbles(b[:, 16:], 4).reshape(n, 8, 32).float()
    return ((d * sc)[:, :, None] * q - (dmin * mn)[:, :, None]).reshape(n, 256)


def _q5_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    d, dmin = _f16(b[:, :2]), _f16(b[:, 2:4])
    sc, mn = _scale_min_k4(b[:, 4:16])
    low = _nibbles(b[:, 48:], 4).reshape(n, 8, 32)
    high = _bits(b[:, 16:48], 8, 1)  # bit j of byte i: sub-block j, value i
    q = (low | (high << 4)).float()
    return ((d * sc)[:, :, None] * q - (dmin * mn)[:, :, None]).reshape(n, 256)


def _q6_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    low = _nibbles(b[:, :128], 2).reshape(n, 8, 32)
    high = _bits(b[:, 128:192].reshape(n * 2, 32), 4, 2).reshape(n, 8, 32)
    scales = b[:, 192:208].contiguous().view(torch.int8).float()
    d = (_f16(b[:, 208:210]) * scales)[:, :, None]  # [n, 16, 1]
    q = ((low | (high << 4)).to(torch.int8) - 32).reshape(n, 16, 16).float()
    return (d * q).reshape(n, 256)


def _q2_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    scales = b[:, :16]
    d, dmin = _f16(b[:, 80:82]), _f16(b[:, 82:84])
    dl = (d * (scales & 0x0F).float())[:, :, None]
    ml = (dmin * (scales >> 4).float())[:, :, None]
    q = _bits(b[:, 16:80].reshape(n * 2, 32), 4, 2).reshape(n, 16, 16).float()
    return (dl * q - ml).reshape(n, 256)


def _q3_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    hmask, qs, packed, d = b[:, :32], b[:, 32:96], b[:, 96:108], _f16(b[:, 108:110])
    low = _bits(packed[:, :8], 2, 4).reshape(n, 16)  # [lo nibbles of 8 bytes, hi nibbles]
    high = _bits(packed[:, 8:12], 4, 2).reshape(n, 16)
    scales = ((low & 0x0F) | ((high & 0x03) << 4)).to(torch.int8) - 32
    dl = (d * scales.float()).reshape(n, 16, 1)
    ql = _bits(qs.reshape(n * 2, 32), 4, 2).reshape(n, 16, 16)
    qh = _bits(hmask, 8, 1).reshape(n, 16, 16) ^ 1  # the offset is applied where the mask bit is 0
    q = (ql.to(torch.int8) - (qh << 2).to(torch.int8)).float()
    return (dl * q).reshape(n, 256)


_BLOCKS: dict[int, Callable[[torch.Tensor], torch.Tensor]] = {
    Q4_0: _q4_0, Q4_1: _q4_1, Q5_0: _q5_0, Q5_1: _q5_1, Q8_0: _q8_0,
    Q2_K: _q2_k, Q3_K: _q3_k, Q4_K: _q4_k, Q5_K: _q5_k, Q6_K: _q6_k,
}  # fmt: skip


def dequantize(raw: torch.Tensor, qtype: int) -> torch.Tensor:
    """raw uint8 [..., row_bytes] (whole rows of GGUF blocks) -> float32 [..., K]."""
    t = ALL_TYPES.get(qtype)
    if raw.dtype != torch.uint8:
        raise TypeError(f"dequantize takes the raw uint8 bytes, got {raw.dtype}")
    lead, nbytes = raw.shape[:-1], raw.shape[-1]
    if t is None or nbytes % t.type_size:
        raise GGUFError(f"{nbytes} bytes per row is not a whole number of {t.name if t else qtype} blocks")
    k = nbytes // t.type_size * t.block_size
    flat = raw.reshape(-1, nbytes)
    if qtype == F32:
        out = flat.contiguous().view(torch.float32).clone()  # never a view of the caller's bytes
    elif qtype == F16:
        out = flat.contiguous().view(torch.float16).float()
    elif qtype == BF16:
        out = (flat.contiguous().view(torch.int16).to(torch.int32) << 16).view(torch.float32)
    elif qtype in _BLOCKS:
        if flat.numel() == 0:
            out = torch.empty(flat.shape[0], k, dtype=torch.float32, device=raw.device)
        else:
            out = _BLOCKS[qtype](flat.reshape(-1, t.type_size)).reshape(flat.shape[0], k)
    else:
        raise GGUFError(f"no dequantization for ggml type {t.name}")
    return out.reshape(*lead, k)
