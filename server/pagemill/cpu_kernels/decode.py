"""Bindings of the decode family: whole decoder layers in one call (csrc/decode/), paged and
prefill attention and the KV write (csrc/attention/)."""

from __future__ import annotations

import ctypes

import torch

from pagemill.cpu_kernels.build import library, wrapper

# fp8 pools the attention kernel reads (decode.cpp's fp8 codes).
FP8_CACHE = {torch.float8_e4m3fn: 0, torch.float8_e5m2: 1}


class DecodeKernels:
    """decode.cpp's entry points; the tensors' layout is checked by the callers
    (models/fused_decode.py, attention/torch_backend.py)."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        vp, i64, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
        # Every layer in one call: float32, bf16 (+ the multiply's variant) and int8 (+ the pool's dtype).
        layers = [vp, i64, i64, vp, vp, f32, f32, vp, vp, vp, vp, i64, vp, vp, vp, ctypes.c_int]
        self.layers = lib.pagemill_decode_layers
        self.layers.restype = ctypes.c_int
        self.layers.argtypes = layers + [vp]
        self.layers_bf16 = lib.pagemill_decode_layers_bf16
        self.layers_bf16.restype = ctypes.c_int
        self.layers_bf16.argtypes = layers + [ctypes.c_int, vp]
        # The layers of an int8 model: the pool's dtype (0 float32, 1 bf16) after the threads.
        self.layers_int8 = lib.pagemill_decode_layers_int8
        self.layers_int8.restype = ctypes.c_int
        self.layers_int8.argtypes = layers + [ctypes.c_int, vp]
        self.layer_int8_ptrs = int(lib.pagemill_decode_layer_int8_ptrs())
        self.layer_int8_max_rows = int(lib.pagemill_decode_layer_int8_max_rows())
        # decode_gguf.cpp: the layers of a model whose linears are GGUF blocks (models/fused_decode.py's
        # GGUFFusedDecoder): flags and the windowed layers' cos/sin after the scale, the pool's dtype
        # (0 float32, 1 bf16) after the block tables.
        self.layers_gguf = lib.pagemill_decode_layers_gguf
        self.layers_gguf.restype = ctypes.c_int
        self.layers_gguf.argtypes = [vp, i64, i64, vp, vp, f32, f32, ctypes.c_int, vp, vp, vp, vp, vp, vp, i64, vp, vp,
                                     vp, ctypes.c_int, ctypes.c_int, vp]  # fmt: skip
        self.layer_gguf_ptrs = int(lib.pagemill_decode_gguf_ptrs())
        self.layer_gguf_max_rows = int(lib.pagemill_decode_gguf_max_rows())
        self.layer_ptrs = int(lib.pagemill_decode_layer_ptrs())
        self.layer_dims = int(lib.pagemill_decode_layer_dims())
        self.layer_max_rows = int(lib.pagemill_decode_layer_max_rows())
        # decode_batched.cpp: the bf16 layer with gemm_bf16's linears (models/batched_decode.py).
        # All the layers in one call, a decode step's or the rows of prompt chunks (cu_seqlens_q, or null).
        self.batched_layers_bf16 = lib.pagemill_batched_layers_bf16
        self.batched_layers_bf16.restype = ctypes.c_int
        self.batched_layers_bf16.argtypes = [vp, vp, i64, i64, vp, vp, f32, f32, vp, vp, vp, vp, i64, vp, vp, i64, vp,
                                             i64, vp, ctypes.c_int, vp]  # fmt: skip
        self.batched_ptrs = int(lib.pagemill_decode_batched_ptrs())
        self.batched_dims = int(lib.pagemill_decode_batched_dims())
        self.attention = lib.pagemill_paged_attention
        self.attention.restype = ctypes.c_int
        self.attention.argtypes = [vp, i64, vp, vp, vp, i64, vp, vp] + [i64] * 5 + [f32, i64, ctypes.c_int]
        self.attention_bf16 = lib.pagemill_paged_attention_bf16
        self.attention_bf16.restype = ctypes.c_int
        self.attention_bf16.argtypes = self.attention.argtypes
        self.attention_fp8 = lib.pagemill_paged_attention_fp8
        self.attention_fp8.restype = ctypes.c_int
        self.attention_fp8.argtypes = [vp, ctypes.c_int, ctypes.c_int] + self.attention.argtypes[1:]
        self.attention_int8 = lib.pagemill_paged_attention_int8  # paged_attention_int8.cpp
        self.attention_int8.restype = ctypes.c_int
        self.attention_int8.argtypes = [vp, ctypes.c_int] + self.attention.argtypes[1:]
        self.prefill = lib.pagemill_prefill_attention  # prefill_attention.cpp
        self.prefill.restype = ctypes.c_int
        self.prefill.argtypes = [vp, ctypes.c_int, i64, vp, vp, vp, i64, vp, vp, vp] + [i64] * 5 + [f32, i64, ctypes.c_int]
        # Whether bf16 prompt chunks of a head size multiply on AMX tiles (prefill_attention_amx.h).
        self.prefill_amx = lib.pagemill_prefill_attention_amx
        self.prefill_amx.restype = ctypes.c_int
        self.prefill_amx.argtypes = [i64]
        self._write_kv = lib.pagemill_write_kv  # kv_write.cpp
        self._write_kv.restype = i64
        self._write_kv.argtypes = [vp, i64, vp, i64, i64, i64, vp, i64, vp, vp]

    @staticmethod
    def write_kv_applies(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         slots: torch.Tensor) -> bool:
        """Whether write_kv takes these: CPU tensors, the pool in k's dtype (no cast), each token's
        heads contiguous, contiguous pools and int64 slots."""
        return (k.device.type == "cpu" and k.dtype == v.dtype == k_cache.dtype == v_cache.dtype
                and k.shape[1:] == v.shape[1:] == k_cache.shape[2:] == v_cache.shape[2:]
                and k.stride(2) == v.stride(2) == 1 and k.stride(1) == v.stride(1) == k.shape[2]
                and k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.shape == v_cache.shape
                and slots.dtype == torch.int64 and slots.is_contiguous() and slots.device.type == "cpu")  # fmt: skip

    def write_kv(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slots: torch.Tensor) -> None:
        """k_cache/v_cache [blocks, block_size, kv_heads, head_dim] at flat slot slots[t] = k[t] / v[t]
        [T, kv_heads, head_dim], as index_copy_ (write_kv_applies must hold); raises IndexError on
        a slot outside the pool (nothing written from that token on)."""
        row = k.shape[1] * k.shape[2] * k.element_size()
        size = k.element_size()
        rc = self._write_kv(k.data_ptr(), k.stride(0) * size, v.data_ptr(), v.stride(0) * size, k.shape[0], row,
                            slots.data_ptr(), k_cache.shape[0] * k_cache.shape[1], k_cache.data_ptr(),
                            v_cache.data_ptr())  # fmt: skip
        if rc:
            slots_in_pool = k_cache.shape[0] * k_cache.shape[1]
            raise IndexError(f"write_kv: slot {int(slots[rc - 1])} is outside the pool's {slots_in_pool}")

    def paged_attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                        window: int | None = None) -> torch.Tensor:
        """q [B, heads, head_dim] float32 or bfloat16 (heads contiguous), caches [blocks, block_size,
        kv_heads, head_dim] of q's dtype or fp8 (FP8_CACHE), or int8 [..., head_dim + 4] (rows with
        their scales, attention/kv_dtype.py), contiguous, block_tables [B, W] / context_lens [B] int32
        contiguous -> [B, heads, head_dim] of q's dtype (float32 arithmetic either way).
        window: each query sees only its last `window` keys (a sliding-window layer)."""
        b, heads, d = q.shape
        block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
        out = torch.empty((b, heads, d), dtype=q.dtype)
        args = (q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(), block_tables.shape[1],
                context_lens.data_ptr(), out.data_ptr(), b, heads, kv_heads, d, block_size, scale, window or 0,
                torch.get_num_threads())  # fmt: skip
        if k_cache.dtype == torch.int8:
            rc = self.attention_int8(q.data_ptr(), int(q.dtype == torch.bfloat16), *args)
        elif k_cache.dtype in FP8_CACHE:  # entries widened exactly: the pool's scale is 1 (kv_dtype.KV_SCALE)
            rc = self.attention_fp8(q.data_ptr(), int(q.dtype == torch.bfloat16), FP8_CACHE[k_cache.dtype], *args)
        else:
            rc = (self.attention_bf16 if q.dtype == torch.bfloat16 else self.attention)(q.data_ptr(), *args)
        if rc != 0:
            raise ValueError(f"paged attention: {heads} heads is not a multiple of {kv_heads} kv heads")
        return out

    def prefill_on_amx(self, head_dim: int) -> bool:
        """Whether bf16 prompt chunks of this head size multiply on AMX tiles (prefill_attention_amx.h)."""
        return bool(self.prefill_amx(head_dim))

    def prefill_attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor, kv_lens: torch.Tensor, scale: float,
                          window: int | None = None) -> torch.Tensor:  # fmt: skip
        """Prompt chunks (prefill_attention.h): q [T, heads, head_dim] float32 or bfloat16 (heads
        contiguous), sequence b's new tokens rows cu_seqlens_q[b]..cu_seqlens_q[b+1]-1, attending
        causally to the kv_lens[b] keys of its cache (the new ones last, written already);
        caches [blocks, block_size, kv_heads, head_dim] of q's dtype, contiguous; block_tables
        [B, W], cu_seqlens_q [B + 1], kv_lens [B] int32 contiguous -> [T, heads, head_dim] of q's
        dtype (float32 arithmetic). window: as paged_attention."""
        t, heads, d = q.shape
        block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
        out = torch.empty((t, heads, d), dtype=q.dtype)
        rc = self.prefill(q.data_ptr(), int(q.dtype == torch.bfloat16), q.stride(0), k_cache.data_ptr(),
                          v_cache.data_ptr(), block_tables.data_ptr(), block_tables.shape[1], cu_seqlens_q.data_ptr(),
                          kv_lens.data_ptr(), out.data_ptr(), kv_lens.shape[0], heads, kv_heads, d, block_size, scale,
                          window or 0, torch.get_num_threads())  # fmt: skip
        if rc == 1:
            raise ValueError(f"prefill attention: {heads} heads is not a multiple of {kv_heads} kv heads")
        if rc != 0:
            raise ValueError("prefill attention: a sequence has fewer keys than new tokens")
        return out


def decode_kernels() -> DecodeKernels | None:
    """The process-wide decode kernels; None where unavailable."""
    lib = library()
    return None if lib is None else wrapper("decode", DecodeKernels, lib)
