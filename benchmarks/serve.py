"""Serving benchmark entry point: the same as `pagemill bench ...`.

    python benchmarks/serve.py suite --out benchmarks/results/cpu-smollm2
    python benchmarks/serve.py serve --base-url http://127.0.0.1:3000 --max-concurrency 16
See docs/benchmarks.md.
"""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "server"))

from pagemill.cli import main  # noqa: E402

if __name__ == "__main__":
    main(["bench", *sys.argv[1:]])
