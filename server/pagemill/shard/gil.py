"""The shard's GIL handed between its two Python threads every 0.2 ms instead of every 5.

Why: the shard has two threads that run Python: the model thread (the forward, a ctypes call
per layer with a few lines of Python between them, then sampling and the step's bookkeeping)
and the event loop's (gRPC: the next step's request, which the router sends while this step
computes, and the previous step's reply). When the model thread comes back from a layer and
the loop's thread holds the GIL, it waits until that thread blocks or until the switch
interval (5 ms by default) forces a hand-over. Measured on the c=64 workload
(benchmarks/paired_burst.py, two servers side by side, alternating bursts, two runs,
2026-12-06, docs/cpu.md "The GIL's switch interval"): with 0.2 ms the server was ahead in 13
of 14 pairs, by 1-2%, its mean forward ~0.2-0.6 ms shorter.
"""

from __future__ import annotations

import sys

SWITCH_INTERVAL_S = 2e-4


def shorten_gil_switch(interval_s: float = SWITCH_INTERVAL_S) -> None:
    """Sets the interpreter's switch interval for the whole process (it is process-wide)."""
    sys.setswitchinterval(interval_s)
