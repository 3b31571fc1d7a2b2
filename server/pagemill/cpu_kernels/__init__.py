"""Small C++ kernels for the CPU decode hot path, compiled on first use.

Only the float32 matrix-vector product lives here (matvec.cpp says why).
It is built once per machine with the system C++ compiler (`$CXX`, else
g++/c++) and `-march=native`, cached under `$PAGEMILL_KERNEL_CACHE`
(default `~/.cache/pagemill/kernels`), and loaded with ctypes: no ninja, no
torch headers, so the build takes about a second. When no compiler is found
or the build fails, `matvec_kernel()` returns None once (logged) and callers
keep torch's own linear. `pagemill launch --no-cpu-kernels` turns it off.
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
from pathlib import Path

import torch

log = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("matvec.cpp")
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c++17"]
_lock = threading.Lock()
_state: dict[str, object] = {}


class MatvecKernel:
    """y = x @ w.T (+ bias) for 1..max_rows rows of float32, through the compiled library."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._fn = lib.pagemill_matvec
        self._fn.restype = ctypes.c_int
        self._fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3 + [ctypes.c_int]
        self.max_rows = int(lib.pagemill_matvec_max_rows())

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x [M, K] contiguous float32 CPU, weight [N, K] contiguous, bias [N] or None."""
        m, k = x.shape
        n = weight.shape[0]
        y = torch.empty((m, n), dtype=torch.float32)
        rc = self._fn(x.data_ptr(), weight.data_ptr(), 0 if bias is None else bias.data_ptr(), y.data_ptr(),
                      m, n, k, torch.get_num_threads())  # fmt: skip
        if rc != 0:
            raise ValueError(f"matvec kernel takes 1..{self.max_rows} rows, got {m}")
        return y


def matvec_kernel() -> MatvecKernel | None:
    """The process-wide kernel, built or loaded on first call; None where unavailable."""
    with _lock:
        if "matvec" not in _state:
            _state["matvec"] = _load()
        return _state["matvec"]  # type: ignore[return-value]


def _load() -> MatvecKernel | None:
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return None  # the build line and the OpenMP sharing below are only checked there
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if not cxx:
        log.info("cpu kernels: no C++ compiler found; using torch's linear for decode")
        return None
    try:
        path = _build(cxx)
        # torch is imported, so its libgomp.so.1 is loaded: the library's
        # NEEDED libgomp.so.1 resolves to it and the two share one pool.
        return MatvecKernel(ctypes.CDLL(str(path)))
    except (OSError, subprocess.SubprocessError) as e:
        log.warning("cpu kernels: build or load failed (%s); using torch's linear for decode", e)
        return None


def _build(cxx: str) -> Path:
    source = _SOURCE.read_bytes()
    # -march=native: the binary is only valid for this CPU, so its flags are part of the key.
    key = hashlib.sha256(source + " ".join([cxx, *_FLAGS, _cpu_flags()]).encode()).hexdigest()[:16]
    cache = Path(os.environ.get("PAGEMILL_KERNEL_CACHE") or Path.home() / ".cache" / "pagemill" / "kernels")
    path = cache / f"matvec-{key}.so"
    if path.exists():
        return path
    cache.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename: concurrent shards never load a half-written file.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=cache)
    os.close(fd)
    try:
        subprocess.run([cxx, *_FLAGS, str(_SOURCE), "-o", tmp], check=True, capture_output=True, timeout=120)
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
