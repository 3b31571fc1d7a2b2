"""A GGUF model -> a Hugging Face model directory with float32 safetensors weights.

files.py writes what the router needs; this adds the weights, dequantized, so that the
directory loads in our shard and in transformers alike (the default model is served this
way, `pagemill convert` writes it, and tests use it as a reference).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import torch
from safetensors.torch import save_file

from pagemill.models.gguf.files import replace_dir, write_small_files
from pagemill.models.gguf.names import weight_plan
from pagemill.models.gguf.reader import GGUFModel
from pagemill.models.gguf.weights import float_weight


def dequantized_weights(g: GGUFModel, config: dict[str, Any]) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, float32 tensor) of every weight of the file."""
    for w in weight_plan(g, config):
        yield w.hf, float_weight(g, w, config)


def write_hf_dir(g: GGUFModel, out: Path) -> None:
    """Every file of the HF directory into `out` (which must exist)."""
    config = write_small_files(g, out)
    tensors = dict(dequantized_weights(g, config))
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})


def convert_gguf_to_hf(gguf_path: str | Path, out_dir: str | Path) -> Path:
    """Convert `gguf_path` (a file, or any part of a split set) into the HF directory `out_dir`."""
    gguf_path = Path(gguf_path)
    if not gguf_path.is_file():
        raise FileNotFoundError(f"no GGUF file at {gguf_path}")
    return replace_dir(Path(out_dir), lambda tmp: write_hf_dir(GGUFModel(gguf_path), tmp))
