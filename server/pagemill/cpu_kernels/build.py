"""Builds and loads the CPU kernel library.

One library from every csrc/**/*.cpp, built with the system C++ compiler (`$CXX`, else
g++/c++) and `-march=native`, cached under `$PAGEMILL_KERNEL_CACHE` (default
`~/.cache/pagemill/kernels`) under a key of its sources, headers, flags and the CPU's flags,
and loaded with ctypes. `build_library(extra_flags)` builds a variant (the tests build one
with the AVX-512 paths compiled out to check the fallback).
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
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

log = logging.getLogger(__name__)

_CSRC = Path(__file__).parent / "csrc"
_SOURCES = sorted(_CSRC.rglob("*.cpp"))
# Every header, for the cache key: an edit to a header alone must rebuild the library.
_HEADERS = sorted(_CSRC.rglob("*.h"))
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c++17"]
# Per compiler call; a busy 2-core machine compiles the largest source in about a minute.
_TIMEOUT_S = 600
_lock = threading.Lock()
_state: dict[str, object] = {}


def library() -> ctypes.CDLL | None:
    """The process-wide library, built or loaded on first call; None where unavailable."""
    with _lock:
        if "lib" not in _state:
            _state["lib"] = _load()
        return _state["lib"]  # type: ignore[return-value]


def wrapper(name: str, cls, lib: ctypes.CDLL):
    """The process-wide binding `cls(lib)` under `name`, made once."""
    with _lock:
        if name not in _state:
            _state[name] = cls(lib)
        return _state[name]


def build_library(extra_flags: tuple[str, ...] = ()) -> ctypes.CDLL | None:
    """A library built with `extra_flags` after the usual ones (e.g. ("-mno-avx512f",) to
    compile the AVX-512 paths out), not shared with library()."""
    return _load(tuple(extra_flags))


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
        detail = (getattr(e, "stderr", None) or b"")[-2000:].decode(errors="replace")
        log.warning("cpu kernels: build or load failed (%s)%s; using torch's ops for decode", e,
                    f":\n{detail}" if detail else "")  # fmt: skip
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
        with tempfile.TemporaryDirectory(dir=cache) as work:
            objects = _compile_each(cxx, flags, work)
            subprocess.run([cxx, *flags, *objects, "-o", tmp], check=True, capture_output=True, timeout=_TIMEOUT_S)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    log.info("cpu kernels: built %s", path)
    return path


def _compile_each(cxx: str, flags: list[str], work: str) -> list[str]:
    """Every source to an object in `work`, one compiler per core: a whole -O3 build in one
    compiler takes minutes on a small machine, most of it in a few files."""
    objects = [os.path.join(work, f"{i}.o") for i in range(len(_SOURCES))]

    def one(i: int) -> None:
        cmd = [cxx, *flags, f"-I{_CSRC}", "-c", str(_SOURCES[i]), "-o", objects[i]]
        subprocess.run(cmd, check=True, capture_output=True, timeout=_TIMEOUT_S)

    with ThreadPoolExecutor(max_workers=max(1, min(len(_SOURCES), os.cpu_count() or 1))) as pool:
        list(pool.map(one, range(len(_SOURCES))))  # re-raises the first failure
    return objects


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()
