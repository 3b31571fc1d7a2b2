"""Every CPU kernel header includes what it uses: each one compiles alone, first in its unit,
on every instruction-set path (a header that only compiled after code above it would
break the next source that includes it first)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

CSRC = Path(__file__).resolve().parents[1] / "server" / "pagemill" / "cpu_kernels" / "csrc"
HEADERS = sorted(p.relative_to(CSRC).as_posix() for p in CSRC.rglob("*.h"))
CXX = shutil.which("g++") or shutil.which("c++")


@pytest.mark.skipif(CXX is None, reason="no C++ compiler")
# Sapphire Rapids turns on every path (AVX-512, BF16, VNNI, AMX); x86-64-v3 is AVX2 alone.
# -fsyntax-only: the compiler checks code this CPU could not run.
@pytest.mark.parametrize("flags", [("-march=sapphirerapids",), ("-march=x86-64-v3",), ("-march=native",)],
                         ids=["all-paths", "avx2", "native"])
def test_each_header_compiles_alone(tmp_path, flags):
    assert HEADERS, f"no headers under {CSRC}"
    failed = {}
    for header in HEADERS:
        unit = tmp_path / "unit.cpp"
        unit.write_text(f'#include "{header}"\n')
        r = subprocess.run([CXX, "-std=c++17", "-fopenmp", *flags, "-fsyntax-only", f"-I{CSRC}", str(unit)],
                           capture_output=True, text=True)  # fmt: skip
        if r.returncode != 0:
            failed[header] = r.stderr.strip().splitlines()[:3]
    assert not failed, failed
