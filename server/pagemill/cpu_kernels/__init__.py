"""Small C++ kernels for the CPU decode hot path, compiled on first use.

- matvec.cpp: the matrix-vector product of single-row linears.
- decode.cpp: a whole decoder layer for one token, and paged attention for a
  batch of single-token queries (each file says why).
- gemm_bf16.cpp: the bfloat16 linear from 2 rows up, over a packed weight
  (wrapped by gemm.py).
- int8_linear.cpp: the int8-weight, int8-activation linear of `--quantize int8`
  (wrapped by int8.py; its arithmetic is in int8_rows.h, which decode.cpp's
  int8 layer shares).
- kv_write.cpp: a layer's new keys and values copied into their pool slots.
- decode_batched.cpp: a whole bf16 decoder layer for 5+ single-token sequences
  with gemm_bf16's linears (wrapped by models/batched_decode.py).
- greedy.cpp, norm.cpp, elementwise.cpp: row-wise bf16 operations (wrapped by rowwise.py).

Each in float32 and bfloat16 (bf16_rows.h: AVX512-BF16 dot products where the
CPU has them, else widened to float32; a scalar fallback without AVX-512).

They form one library, built once per machine with the system C++ compiler (`$CXX`, else
g++/c++) and `-march=native`, cached under `$PAGEMILL_KERNEL_CACHE`
(default `~/.cache/pagemill/kernels`), and loaded with ctypes: no ninja, no
torch headers, so the build takes about a second. When no compiler is found
or the build fails, `matvec_kernel()` / `decode_kernels()` return None (logged once) and
callers keep torch's own ops. `pagemill launch --no-cpu-kernels` turns it off.
`build_library(extra_flags)` builds a variant (the tests build one with the
AVX-512 paths compiled out to check the fallback).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

import torch

log = logging.getLogger(__name__)

_DIR = Path(__file__).parent
_SOURCES = [_DIR / "matvec.cpp", _DIR / "decode.cpp", _DIR / "int8_linear.cpp", _DIR / "greedy.cpp",
            _DIR / "norm.cpp", _DIR / "elementwise.cpp", _DIR / "paged_attention_int8.cpp", _DIR / "prefill_attention.cpp",
            _DIR / "gemm_bf16.cpp", _DIR / "kv_write.cpp", _DIR / "decode_batched.cpp",
            _DIR / "threads.cpp", _DIR / "read_rate.cpp"]
# Every header, for the cache key: a hand-kept list missed the ones added later, and an edit
# to those alone would have loaded the library built before it.
_HEADERS = sorted(_DIR.glob("*.h"))
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c++17"]
_lock = threading.Lock()
_state: dict[str, object] = {}


# fp8 pools the attention kernel reads (decode.cpp's fp8 codes).
FP8_CACHE = {torch.float8_e4m3fn: 0, torch.float8_e5m2: 1}

# How the bf16 kernels multiply (bf16_rows.h's Bf16Mul); AUTO: the measured default.
BF16_MUL = {"auto": -1, "dpbf16": 0, "widen": 1}


class MatvecKernel:
    """y = x @ w.T (+ bias) for 1..max_rows rows of float32 or bfloat16 (x, weight and
    bias of one dtype), through the compiled library."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._fn = lib.pagemill_matvec
        self._fn.restype = ctypes.c_int
        self._fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3 + [ctypes.c_int]
        self._bf16 = lib.pagemill_matvec_bf16
        self._bf16.restype = ctypes.c_int
        self._bf16.argtypes = self._fn.argtypes + [ctypes.c_int]
        self.max_rows = int(lib.pagemill_matvec_max_rows())

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                 mul: str = "auto") -> torch.Tensor:  # fmt: skip
        """x [M, K] contiguous float32 or bfloat16 CPU, weight [N, K] contiguous, bias [N] or None.
        mul: bf16 only, how to multiply (BF16_MUL; benchmarks compare them)."""
        m, k = x.shape
        n = weight.shape[0]
        y = torch.empty((m, n), dtype=x.dtype)
        args = (x.data_ptr(), weight.data_ptr(), 0 if bias is None else bias.data_ptr(), y.data_ptr(), m, n, k,
                torch.get_num_threads())  # fmt: skip
        rc = self._bf16(*args, BF16_MUL[mul]) if x.dtype == torch.bfloat16 else self._fn(*args)
        if rc != 0:
            raise ValueError(f"matvec kernel takes 1..{self.max_rows} rows, got {m}")
        return y


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


def matvec_kernel() -> MatvecKernel | None:
    """The process-wide matvec, built or loaded on first call; None where unavailable."""
    lib = _library()
    return None if lib is None else _wrapper("matvec", MatvecKernel, lib)


def decode_kernels() -> DecodeKernels | None:
    """The process-wide decode kernels; None where unavailable."""
    lib = _library()
    return None if lib is None else _wrapper("decode", DecodeKernels, lib)


def plain_read() -> Callable[[torch.Tensor], float] | None:
    """fn(t): every byte of a contiguous CPU float32 tensor read once by the torch thread count,
    64 bytes a load (read_rate.cpp; the benchmarks' floors); None where the library is unavailable."""
    lib = _library()
    if lib is None:
        return None
    fn = lib.pagemill_read
    fn.restype = ctypes.c_float
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int]
    return lambda t: fn(t.data_ptr(), t.numel() * t.element_size(), torch.get_num_threads())


def build_library(extra_flags: tuple[str, ...] = ()) -> ctypes.CDLL | None:
    """A library built with `extra_flags` after the usual ones (e.g. ("-mno-avx512f",) to
    compile the AVX-512 paths out), not shared with matvec_kernel()/decode_kernels()."""
    return _load(tuple(extra_flags))


def _wrapper(name: str, cls, lib: ctypes.CDLL):
    with _lock:
        if name not in _state:
            _state[name] = cls(lib)
        return _state[name]


def _library() -> ctypes.CDLL | None:
    with _lock:
        if "lib" not in _state:
            _state["lib"] = _load()
        return _state["lib"]  # type: ignore[return-value]


def _load(extra_flags: tuple[str, ...] = ()) -> ctypes.CDLL | None:
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return None  # the build line and the OpenMP sharing below are only checked there
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if not cxx:
        log.info("cpu kernels: no C++ compiler found; using torch's ops for decode")
        return None
    try:
        path = _build(cxx, [*_FLAGS, *extra_flags])
        # torch is imported, so its libgomp.so.1 is loaded: the library's
        # NEEDED libgomp.so.1 resolves to it and the two share one pool.
        return ctypes.CDLL(str(path))
    except (OSError, subprocess.SubprocessError) as e:
        log.warning("cpu kernels: build or load failed (%s); using torch's ops for decode", e)
        return None


def _build(cxx: str, flags: list[str]) -> Path:
    source = b"".join(f.read_bytes() for f in _SOURCES + _HEADERS)
    # -march=native: the binary is only valid for this CPU, so its flags are part of the key.
    key = hashlib.sha256(source + " ".join([cxx, *flags, _cpu_flags()]).encode()).hexdigest()[:16]
    cache = Path(os.environ.get("PAGEMILL_KERNEL_CACHE") or Path.home() / ".cache" / "pagemill" / "kernels")
    path = cache / f"cpu-kernels-{key}.so"
    if path.exists():
        return path
    cache.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename: concurrent shards never load a half-written file.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=cache)
    os.close(fd)
    try:
        subprocess.run([cxx, *flags, f"-I{_DIR}", *map(str, _SOURCES), "-o", tmp], check=True, capture_output=True, timeout=120)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    log.info("cpu kernels: built %s", path)
    return path


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()
