"""Where the benchmark scripts find the repository: from this file's path, never from the
working directory, so a script writes its results into this checkout wherever it is started.

Every script in benchmarks/ imports this first (`import _repo`; a script's own folder is on
sys.path when it runs). Where pagemill is not installed, importing it also puts this checkout's
server/ on sys.path, so `python benchmarks/x.py` works from a plain clone.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"

if importlib.util.find_spec("pagemill") is None:
    sys.path.insert(0, str(ROOT / "server"))


def results(benchmark: str, name: str | None = None) -> str:
    """benchmarks/results/<benchmark>/ (or a file in it) in this checkout, as a string."""
    path = RESULTS / benchmark
    return str(path / name if name else path)
