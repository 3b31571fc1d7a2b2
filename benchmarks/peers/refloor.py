"""Recompute the floors of an earlier `pagemill bench compare` run from what it measured.

    python benchmarks/peers/refloor.py benchmarks/results/compare-c64

Each run's compare.json keeps the machine figures measured before that
server started (read and copy bandwidth, GEMM rates); this applies the
current bench/compare_floors.py to them (the batch-1 floor and the c=N
roofline ceiling) and rewrites compare.json, compare.md and compare.png.
No server is started and no figure is measured again, and no row is added
to the folder's history.jsonl (the run is the same one).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from argparse import Namespace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/, for _repo
import _repo  # noqa: E402,F401  (the repository from this file's path)


def refloor(out: str) -> None:
    from tokenizers import Tokenizer

    from pagemill.bench.compare import workload_requests, write
    from pagemill.bench.compare_floors import batch1_floor_ms, workload_ceiling
    from pagemill.bench.roofline import Machine
    from pagemill.models.config import ModelConfig

    with open(os.path.join(out, "compare.json")) as f:
        res = json.load(f)
    a = Namespace(**res["args"])
    cfg = ModelConfig.from_model_dir(res["model_dir"])
    main_reqs, _, _ = workload_requests(a, Tokenizer.from_file(os.path.join(res["model_dir"], "tokenizer.json")))
    for s in res["servers"]:
        for r in s["runs"]:
            if "machine" not in r or "summary" not in r:
                continue
            m = Machine(**r["machine"])
            r["summary"]["batch1_floor_ms"] = batch1_floor_ms(cfg, m, s["precision"], 64 + a.batch1_output_len // 2)
            r["summary"]["ceiling_tok_s"] = workload_ceiling(cfg, m, s["precision"], main_reqs)
            r["summary"]["bandwidth_gbs"] = m.sum_gbs
    write(res, out, record=False)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", help="a compare run's folder (its compare.json is rewritten)")
    refloor(p.parse_args().out)


if __name__ == "__main__":
    main()
