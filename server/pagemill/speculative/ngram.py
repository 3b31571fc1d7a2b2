"""N-gram prompt lookup: propose what followed the last n tokens the last time they occurred.

No second model: copy-heavy outputs (summaries that quote, code edits,
extraction) repeat spans of their context, and the continuation of the most
recent earlier occurrence of the current suffix is a cheap, often right
guess. Longer suffixes are tried first (fewer, better matches).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np


def propose_ngram(tokens: Sequence[int], k: int, max_n: int = 3, min_n: int = 1) -> list[int]:
    """Up to k tokens following the most recent earlier match of the last n tokens."""
    if k <= 0 or len(tokens) < min_n + 1:
        return []
    arr = np.asarray(tokens, dtype=np.int64)
    for n in range(min(max_n, len(arr) - 1), min_n - 1, -1):
        suffix = arr[-n:]
        # Windows that start before the suffix itself: arr[i : i + n] for i < len - n.
        windows = np.lib.stride_tricks.sliding_window_view(arr[:-1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n  # most recent occurrence
            return arr[start : start + k].tolist()
    return []
