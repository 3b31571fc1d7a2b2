"""Serving benchmark entry point: the same as `pagemill bench ...`.

    python benchmarks/serve.py suite --out benchmarks/results/suite
    python benchmarks/serve.py serve --base-url http://127.0.0.1:3000 --max-concurrency 16
See docs/benchmarks.md.
"""

import sys

import _repo  # noqa: F401  (the repository from this file's path)
from pagemill.cli import main

if __name__ == "__main__":
    main(["bench", *sys.argv[1:]])
