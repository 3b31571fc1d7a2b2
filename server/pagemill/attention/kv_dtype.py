"""The KV cache's storage dtype (`--kv-cache-dtype`): the model's, or fp8.

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

Where it works (check_kv_dtype raises otherwise):
- torch backend: any device (fp8 is a storage dtype on CPU too).
- triton backend: fp8_e5m2 on any CUDA GPU Triton supports; fp8_e4m3 needs
  compute capability >= 8.9 (Ada/Hopper), where Triton has float8e4nv.
  On CPU, Triton's interpreter loads and stores both formats.
- flash backend: flash-attn 2 has no fp8 KV cache. Fresh prompts still run
  flash_attn_varlen_func on the new tokens' full-precision k/v; everything
  that reads the pool runs on the Triton kernels (logged once).
"""

from __future__ import annotations

import torch

KV_CACHE_DTYPES = ("auto", "fp8_e4m3", "fp8_e5m2")
FP8_DTYPES = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
KV_SCALE = 1.0  # per-tensor scale of the fp8 cast (see the module docstring)


def parse_kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """`--kv-cache-dtype` -> the pool's torch dtype; auto is the model's dtype."""
    if name == "auto":
        return model_dtype
    if name not in FP8_DTYPES:
        raise ValueError(f"unknown kv cache dtype {name!r}; choose one of {', '.join(KV_CACHE_DTYPES)}")
    return FP8_DTYPES[name]


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in FP8_DTYPES.values()


def kv_dtype_name(dtype: torch.dtype) -> str:
    """The name Info and the logs report: fp8_e4m3 / fp8_e5m2, or the model dtype's (bfloat16, ...)."""
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


def write_rows(cache_rows: torch.Tensor, slots: torch.Tensor, x: torch.Tensor) -> None:
    """cache_rows[slots] = x in the cache's dtype. CPU has no index_copy_ for fp8:
    the bytes are copied through a uint8 view (fp8 is one byte, so the view is exact)."""
    x = quantize(x, cache_rows.dtype)
    if is_fp8(cache_rows.dtype):
        cache_rows.view(torch.uint8).index_copy_(0, slots, x.view(torch.uint8))
    else:
        cache_rows.index_copy_(0, slots, x)


def check_kv_dtype(kv_dtype: torch.dtype, backend_name: str, device: torch.device | str) -> None:
    """Raises ValueError naming why `kv_dtype` cannot run on `backend_name` / `device`."""
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
