"""Reference quantizers for writing test GGUF files: gguf-py's where it has one (F32, F16,
BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0), and simple numpy ones for the k-quants gguf-py only reads
(Q4_K, Q5_K, Q6_K).

The k-quant scales are chosen by min / max per sub-block (llama.cpp searches for better ones);
the bytes follow ggml's block layouts exactly, which is what a reader has to get right, and
gguf-py's dequantize reads them back (tests/test_gguf_dequant.py checks the round trip).
"""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType
from gguf.quants import quantize as gguf_quantize

QK = 256


def _f16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).astype(np.float32)


def _pack_scales_k4(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """6-bit scales and mins [n, 8] -> Q4_K/Q5_K's 12 packed bytes (inverse of get_scale_min)."""
    sc, mn = sc.astype(np.uint8), mn.astype(np.uint8)
    out = np.zeros((sc.shape[0], 12), dtype=np.uint8)
    out[:, 0:4] = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    out[:, 4:8] = mn[:, :4] | ((mn[:, 4:] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:] & 0x0F) | ((mn[:, 4:] & 0x0F) << 4)
    return out


def _affine_k(blocks: np.ndarray, levels: int) -> tuple[np.ndarray, ...]:
    """Blocks [n, 256] -> (d, dmin as f16 bytes, 6-bit sc, mn [n, 8], q [n, 256] in 0..levels)."""
    n = blocks.shape[0]
    sub = blocks.reshape(n, 8, 32)
    lo = np.minimum(sub.min(axis=2), 0.0)  # the offset is subtracted: min is kept <= 0
    scale = (sub.max(axis=2) - lo) / levels
    d, dmin = _f16(scale.max(axis=1) / 63), _f16(-lo.min(axis=1) / 63)
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(d[:, None] > 0, np.round(scale / d[:, None]), 0).clip(0, 63)
        mn = np.where(dmin[:, None] > 0, np.round(-lo / dmin[:, None]), 0).clip(0, 63)
        step = (d[:, None] * sc)[:, :, None]
        q = np.where(step > 0, np.round((sub + (dmin[:, None] * mn)[:, :, None]) / step), 0)
    q = q.clip(0, levels).astype(np.uint8).reshape(n, QK)
    heads = np.concatenate([d.astype(np.float16)[:, None].view(np.uint8), dmin.astype(np.float16)[:, None].view(np.uint8)], 1)
    return heads, sc, mn, q


def _nibbles(q: np.ndarray) -> np.ndarray:
    """Values [n, 256] (< 16) -> 128 bytes: chunk c's byte i holds sub-block 2c (low) and 2c+1 (high)."""
    v = q.reshape(q.shape[0], 4, 2, 32)
    return (v[:, :, 0] | (v[:, :, 1] << 4)).reshape(q.shape[0], 128)


def quantize_q4_k(blocks: np.ndarray) -> np.ndarray:
    heads, sc, mn, q = _affine_k(blocks, 15)
    return np.concatenate([heads, _pack_scales_k4(sc, mn), _nibbles(q)], axis=1)


def quantize_q5_k(blocks: np.ndarray) -> np.ndarray:
    heads, sc, mn, q = _affine_k(blocks, 31)
    n = q.shape[0]
    high = (q >> 4).reshape(n, 8, 32)  # bit j of byte i: sub-block j, value i
    qh = np.zeros((n, 32), dtype=np.uint8)
    for j in range(8):
        qh |= (high[:, j] << j).astype(np.uint8)
    return np.concatenate([heads, _pack_scales_k4(sc, mn), qh, _nibbles(q & 0x0F)], axis=1)


def quantize_q6_k(blocks: np.ndarray) -> np.ndarray:
    n = blocks.shape[0]
    sub = blocks.reshape(n, 16, 16)
    scale = np.abs(sub).max(axis=2) / 31
    d = _f16(scale.max(axis=1) / 127)
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(d[:, None] > 0, np.round(scale / d[:, None]), 0).clip(-128, 127)
        step = (d[:, None] * sc)[:, :, None]
        q = np.where(step > 0, np.round(sub / step), 0)
    q = (q.clip(-32, 31) + 32).astype(np.uint8).reshape(n, 2, 128)  # per half: value h*128 + v
    low, high = q & 0x0F, q >> 4
    ql = (low[:, :, :64] | (low[:, :, 64:] << 4)).reshape(n, 128)
    qh = np.zeros((n, 2, 32), dtype=np.uint8)
    for s in range(4):
        qh |= (high[:, :, s * 32 : (s + 1) * 32] << (2 * s)).astype(np.uint8)
    return np.concatenate([ql, qh.reshape(n, 64), sc.astype(np.int8).view(np.uint8),
                           d.astype(np.float16)[:, None].view(np.uint8)], axis=1)  # fmt: skip


_K_QUANTIZERS = {GGMLQuantizationType.Q4_K: quantize_q4_k, GGMLQuantizationType.Q5_K: quantize_q5_k,
                 GGMLQuantizationType.Q6_K: quantize_q6_k}  # fmt: skip


def quantize(x: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """float32 [..., K] -> the GGUF bytes [..., row_bytes] (F32/F16: the values themselves)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    if qtype in _K_QUANTIZERS:
        if x.shape[-1] % QK:
            raise ValueError(f"{qtype.name} needs rows of a multiple of {QK} values, got {x.shape[-1]}")
        blocks = x.reshape(-1, QK)
        return _K_QUANTIZERS[qtype](blocks).reshape(*x.shape[:-1], -1)
    return gguf_quantize(x, qtype)
