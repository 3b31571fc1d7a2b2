"""shard/gil.py: the shard process hands the GIL between its threads every 0.2 ms."""

from __future__ import annotations

import inspect
import subprocess
import sys
import textwrap

from pagemill.shard import main
from pagemill.shard.gil import SWITCH_INTERVAL_S

# A child process, so the test process keeps its own interval.
PROBE = textwrap.dedent("""
    import sys
    from pagemill.shard.gil import shorten_gil_switch
    before = sys.getswitchinterval()
    shorten_gil_switch()
    print(before, sys.getswitchinterval())
""")


def test_shorten_gil_switch_sets_the_process_interval():
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, check=True).stdout.split()
    before, after = float(out[0]), float(out[1])
    assert before == 0.005  # the interpreter's default
    assert abs(after - SWITCH_INTERVAL_S) < 1e-6 and SWITCH_INTERVAL_S < before


def test_serve_shortens_it_before_loading():
    src = inspect.getsource(main.serve)
    assert src.index("shorten_gil_switch()") < src.index("ParallelGroup.init")
