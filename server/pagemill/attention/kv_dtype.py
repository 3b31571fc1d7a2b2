"""The KV cache's storage dtype (`--kv-cache-dtype`): the model's, fp8 or int8.

fp8 halves the pool's bytes per token, so the same memory holds twice the
blocks (twice the cached tokens) of a bf16/fp16 pool, four times fp32's.
Keys and values are cast to fp8 when written and widened back to the compute
dtype when read; attention itself (scores, softmax, accumulation) runs in the
model dtype / fp32 as before.

Scale: the cast uses a per-tensor scale of 1.0 (no calibration), which is
also vLLM's default for `--kv-cache-dtype fp8` without scales in the
checkpoint. Values beyond the format's finite range are clamped (saturated)
rather than left to overflow: e4m3fn has no infinity and would turn them into
NaN, e5m2 into inf. `quantize`/`dequantize` take a scale so a calibrated one
can be plugged in later; every backend passes KV_SCALE today.

int8 (symmetric, scaled): each (token, kv head) row of head_dim entries is
stored as round(x * 127 / absmax(x)) in int8 followed by its float32 scale
absmax / 127 in the row's last 4 bytes, so an int8 cache is [num_blocks,
block_size, kv_heads, head_dim + 4] int8 (row_width). Why per (token, head)
and not per (block, head): a block fills one token at a time (decode writes
one row per step, prompt chunks end mid-block), so a block-wide scale would
have to grow, and every earlier row be requantized, whenever a new token's
absmax exceeds it; a row's own scale is final when it is written. The price
is 4 bytes a row: 68 instead of 64 bytes at head_dim 64, 1.88x the tokens of
a bf16 pool instead of 2x. Keeping the scale inside the row means everything
that moves whole blocks (the second KV tier, block copies) carries it
without knowing about it. Attention dequantizes as it reads (the compiled
CPU kernel per row, the torch path by widen()).

Where it works (check_kv_dtype raises otherwise):
- torch backend: any device (fp8 is a storage dtype on CPU too).
- triton backend: fp8_e5m2 on any CUDA GPU Triton supports; fp8_e4m3 needs
  compute capability >= 8.9 (Ada/Hopper), where Triton has float8e4nv.
  On CPU, Triton's interpreter loads and stores both formats.
- flash backend: flash-attn 2 has no fp8 KV cache. Fresh prompts still run
  flash_attn_varlen_func on the new tokens' full-precision k/v; everything
  that reads the pool runs on the Triton kernels (logged once).
- int8: the torch backend only (the compiled CPU kernel where it applies, the
  torch ops elsewhere); the fused decode layer falls back to the module path.
"""

from __future__ import annotations

import torch

from pagemill.config import KV_CACHE_DTYPES
FP8_DTYPES = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
KV_SCALE = 1.0  # per-tensor scale of the fp8 cast (see the module docstring)
SCALE_BYTES = 4  # an int8 row's float32 scale, after its head_dim entries


def parse_kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """`--kv-cache-dtype` -> the pool's torch dtype; auto is the model's dtype."""
    if name == "auto":
        return model_dtype
    if name == "int8":
        return torch.int8
    if name not in FP8_DTYPES:
        raise ValueError(f"unknown kv cache dtype {name!r}; choose one of {', '.join(KV_CACHE_DTYPES)}")
    return FP8_DTYPES[name]


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in FP8_DTYPES.values()


def is_int8(dtype: torch.dtype) -> bool:
    return dtype == torch.int8


def row_width(head_dim: int, dtype: torch.dtype) -> int:
    """Entries a cache row of `head_dim` takes in `dtype`: int8 rows carry their scale."""
    return head_dim + SCALE_BYTES if is_int8(dtype) else head_dim


def head_dim_of(cache: torch.Tensor) -> int:
    """The head_dim a cache [..., row_width] stores."""
    return cache.shape[-1] - SCALE_BYTES if is_int8(cache.dtype) else cache.shape[-1]


def kv_dtype_name(dtype: torch.dtype) -> str:
    """The name Info and the logs report: fp8_e4m3 / fp8_e5m2 / int8, or the model dtype's (bfloat16, ...)."""
    for name, fp8 in FP8_DTYPES.items():
        if dtype == fp8:
            return name
    return str(dtype).removeprefix("torch.")


def quantize(x: torch.Tensor, dtype: torch.dtype, scale: float = KV_SCALE) -> torch.Tensor:
    """x in the cache's dtype: a plain cast, or for fp8 a saturating cast of x / scale."""
    if not is_fp8(dtype):
        return x.to(dtype)
    limit = torch.finfo(dtype).max
    if scale != 1.0:
        x = x / scale
    return x.clamp(-limit, limit).to(dtype)


def dequantize(x: torch.Tensor, dtype: torch.dtype, scale: float = KV_SCALE) -> torch.Tensor:
    """Cache entries widened to the compute dtype."""
    out = x.to(dtype)
    return out if scale == 1.0 else out * scale


def quantize_int8(x: torch.Tensor) -> torch.Tensor:
    """x [..., D] -> int8 rows [..., D + 4]: round(x / s) and s = absmax / 127 as float32 bytes.
    An all-zero row gets s = 0 (and reads back as zeros)."""
    x = x.float()
    scale = x.abs().amax(dim=-1, keepdim=True) / 127.0
    inv = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
    q = torch.round(x * inv).clamp_(-127, 127).to(torch.int8)
    return torch.cat([q, scale.view(torch.int8)], dim=-1)


def int8_scales(rows: torch.Tensor) -> torch.Tensor:
    """The float32 scale of each int8 row [..., D + 4] -> [..., 1]."""
    return rows[..., -SCALE_BYTES:].contiguous().view(torch.float32)


def widen(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Cache rows [..., row_width] -> [..., head_dim] in the compute dtype `dtype`."""
    if not is_int8(rows.dtype):
        return rows.to(dtype)
    return (rows[..., :-SCALE_BYTES].float() * int8_scales(rows)).to(dtype)


def write_rows(cache_rows: torch.Tensor, slots: torch.Tensor, x: torch.Tensor) -> None:
    """cache_rows[slots] = x in the cache's dtype. CPU has no index_copy_ for fp8:
    the bytes are copied through a uint8 view (fp8 is one byte, so the view is exact).
    int8: quantized per row with its scale (quantize_int8)."""
    if is_int8(cache_rows.dtype):
        cache_rows.index_copy_(0, slots, quantize_int8(x))
        return
    x = quantize(x, cache_rows.dtype)
    if is_fp8(cache_rows.dtype):
        cache_rows.view(torch.uint8).index_copy_(0, slots, x.view(torch.uint8))
    else:
        cache_rows.index_copy_(0, slots, x)


def check_kv_dtype(kv_dtype: torch.dtype, backend_name: str, device: torch.device | str) -> None:
    """Raises ValueError naming why `kv_dtype` cannot run on `backend_name` / `device`."""
    if is_int8(kv_dtype) and backend_name != "torch":
        raise ValueError(
            f"--kv-cache-dtype int8 runs on the torch attention backend only (its scaled rows are not read by "
            f"the {backend_name} kernels); use --attention torch, or --kv-cache-dtype fp8_e4m3|fp8_e5m2"
        )
    if not is_fp8(kv_dtype):
        return
    device = torch.device(device)
    name = kv_dtype_name(kv_dtype)
    if backend_name in ("triton", "flash") and device.type == "cuda" and kv_dtype == torch.float8_e4m3fn:
        major, minor = torch.cuda.get_device_capability(device)
        if (major, minor) < (8, 9):
            raise ValueError(
                f"--kv-cache-dtype {name} with the {backend_name} attention backend needs a GPU of compute "
                f"capability >= 8.9 (Triton's float8e4nv); this one is {major}.{minor}. "
                "Use --kv-cache-dtype fp8_e5m2, or --attention torch."
            )
