"""The small files of a model directory that a GGUF's metadata gives: config.json,
generation_config.json, tokenizer.json and tokenizer_config.json (with the chat template),
what the router reads. No torch here: the launcher extracts them before any shard starts.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Any, Callable

from pagemill.models.gguf.archs import hf_config
from pagemill.models.gguf.reader import GGUFModel
from pagemill.models.gguf.tokenizer import build_tokenizer, end_of_generation_ids, read_spec, tokenizer_config


def generation_config(config: dict[str, Any], eog: list[int]) -> dict[str, Any]:
    out: dict[str, Any] = {"bos_token_id": config["bos_token_id"], "eos_token_id": eog[0] if len(eog) == 1 else eog}
    if config.get("pad_token_id") is not None:
        out["pad_token_id"] = config["pad_token_id"]
    return out


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def write_small_files(g: GGUFModel, out: Path) -> dict[str, Any]:
    """config.json, generation_config.json, tokenizer.json and tokenizer_config.json into `out`
    (which must exist); returns the config."""
    config = hf_config(g)
    spec = read_spec(g, config["max_position_embeddings"])
    build_tokenizer(spec).save(str(out / "tokenizer.json"))
    _write_json(out / "tokenizer_config.json", tokenizer_config(spec))
    _write_json(out / "config.json", config)
    eog = end_of_generation_ids(spec) or [config["eos_token_id"]]
    _write_json(out / "generation_config.json", generation_config(config, eog))
    return config


def replace_dir(out_dir: Path, write: Callable[[Path], None]) -> Path:
    """Runs write(tmp) on a sibling temp dir and renames it to `out_dir`, so that a crash never
    leaves a half-written `out_dir`. An existing `out_dir` is replaced."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.parent / f".{out_dir.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        write(tmp)
        if out_dir.exists():
            # rename() cannot replace a non-empty dir: move the old one aside first.
            old = out_dir.parent / f".{out_dir.name}.old-{uuid.uuid4().hex[:8]}"
            os.rename(out_dir, old)
            os.rename(tmp, out_dir)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, out_dir)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out_dir
