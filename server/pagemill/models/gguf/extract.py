"""`--model file.gguf`: the small files the router needs, extracted once into a cache directory.

The directory holds config.json, generation_config.json, tokenizer.json and tokenizer_config.json
(convert.write_small_files) and a manifest naming the GGUF file(s) with their size and mtime;
the shards find the weights through the manifest and read them from the GGUF itself
(models/gguf/load.py). An extraction whose manifest no longer matches the files (a file
replaced, a new converter) is redone; a directory without a manifest is never used.
"""

from __future__ import annotations

import fcntl
import json
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from pagemill.models.gguf.files import replace_dir, write_small_files
from pagemill.models.gguf.reader import GGUFModel, split_parts
from pagemill.models.gguf.types import GGUFError

MANIFEST_NAME = "gguf-manifest.json"
# Bump when the extracted files change, so that old extractions are redone.
EXTRACT_VERSION = 1


def file_entries(gguf_path: Path) -> list[dict]:
    """Each file of the model (one, or every part of a split set) with its size and mtime."""
    return [{"path": str(p.resolve()), "size": p.stat().st_size, "mtime_ns": p.stat().st_mtime_ns}
            for p in split_parts(gguf_path)]  # fmt: skip


def read_manifest(model_dir: str | os.PathLike) -> dict | None:
    """The manifest of an extracted directory, None for any other directory."""
    path = Path(model_dir) / MANIFEST_NAME
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except ValueError as e:
        raise GGUFError(f"{path} is not valid JSON ({e}); delete the directory to extract again") from None


def gguf_source(model_dir: str | os.PathLike) -> Path | None:
    """The GGUF file whose weights `model_dir` stands for: itself where it is a .gguf file, the
    manifest's first file for an extracted directory (checked unchanged), else None."""
    path = Path(model_dir)
    if path.is_file() and path.suffix.lower() == ".gguf":
        return path
    manifest = read_manifest(path)
    if manifest is None:
        return None
    files = manifest.get("files") or []
    for f in files:
        p = Path(f["path"])
        if not p.is_file() or p.stat().st_size != f["size"]:
            raise GGUFError(f"{p} (extracted into {path}) is missing or changed size; launch again to re-extract")
    if not files:
        raise GGUFError(f"{path / MANIFEST_NAME} names no GGUF file")
    return Path(files[0]["path"])


def _matches(out_dir: Path, gguf_path: Path) -> bool:
    try:
        manifest = read_manifest(out_dir)
    except GGUFError:
        return False
    return bool(manifest) and manifest.get("version") == EXTRACT_VERSION and manifest.get("files") == file_entries(gguf_path)


@contextmanager
def dir_lock(lock_path: Path) -> Iterator[None]:
    """Launcher and shards may start at once: one writes, the others wait."""
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def extract_cached(gguf_path: Path, out_dir: Path) -> Path:
    """Extracts `gguf_path`'s small files into `out_dir` unless a matching extraction is there."""
    if _matches(out_dir, gguf_path):
        return out_dir
    with dir_lock(out_dir.parent / f".{out_dir.name}.lock"):
        if _matches(out_dir, gguf_path):  # another process finished meanwhile
            return out_dir

        def write(tmp: Path) -> None:
            write_small_files(GGUFModel(gguf_path), tmp)
            manifest = {"version": EXTRACT_VERSION, "files": file_entries(gguf_path)}
            (tmp / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2) + "\n")

        replace_dir(out_dir, write)
    return out_dir


def extraction_dir(gguf_path: Path, cache: Path) -> Path:
    """Where `gguf_path`'s extraction lives: keyed by the (first) file's name and the set's size."""
    size = sum(e["size"] for e in file_entries(gguf_path))
    return cache / "gguf" / f"{gguf_path.stem}-{size}"
