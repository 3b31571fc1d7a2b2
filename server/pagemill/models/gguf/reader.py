"""Opens a GGUF model: one file, or a set split by llama.cpp's gguf-split.

A split set is named `<prefix>-00001-of-0000N.gguf` .. `-0000N-of-0000N.gguf`; every part
carries split.no / split.count / split.tensors.count, the first one all the metadata. Given
any part (or the single file) this finds the rest, checks the set is whole and consistent,
and indexes every tensor of every part by name.

Each part's header is read by header.py (what gguf-py's GGUFReader reads, minutes faster on
large vocabularies) and its data memory-mapped with numpy, copy-on-write (writes, such as a
kernel repacking blocks in place, never reach the file). Tensor bytes are handed out two ways:
`raw` is a zero-copy torch view into the mapping (pages are read on first touch and are shared
page cache), `read` copies the bytes with pread into fresh memory without touching the mapping
(for tensors that are rewritten at load: permuted rows, norms, parts concatenated).
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from pagemill.models.gguf.header import Header, read_header
from pagemill.models.gguf.types import GGMLType, GGUFError, ggml_type

if TYPE_CHECKING:
    import torch

SPLIT_NAME = re.compile(r"^(?P<prefix>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")


@dataclass(frozen=True)
class TensorInfo:
    name: str
    type: GGMLType
    shape: tuple[int, ...]  # slowest-first (numpy/torch order): [..., rows, K]
    path: Path  # the part that holds it
    offset: int  # of its first byte in that file
    n_bytes: int
    part: int  # index of the part

    @property
    def byte_shape(self) -> tuple[int, ...]:
        """Its bytes as rows: [..., rows, row_bytes]."""
        return (*self.shape[:-1], self.type.row_bytes(self.shape[-1]))


def split_parts(path: Path) -> list[Path]:
    """All files of the model `path` belongs to, in order (a single-file model: [path])."""
    m = SPLIT_NAME.match(path.name)
    if m is None:
        return [path]
    count = int(m["count"])
    parts = [path.with_name(f"{m['prefix']}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]
    missing = [p.name for p in parts if not p.is_file()]
    if missing:
        raise GGUFError(f"split GGUF {path.name} is part of {count} files; missing {', '.join(missing)}")
    return parts


class GGUFModel:
    """The metadata (from the first part) and every tensor of a GGUF model."""

    def __init__(self, path: str | os.PathLike) -> None:
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"no GGUF file at {path}")
        self.paths = split_parts(path)
        self.headers: list[Header] = [read_header(p) for p in self.paths]
        self.fields = self.headers[0].fields
        self._check_split()
        self._maps: list[np.memmap | None] = [None] * len(self.paths)
        self.tensors: dict[str, TensorInfo] = {}
        for i, (p, h) in enumerate(zip(self.paths, self.headers)):
            for t in h.tensors:
                if t.name in self.tensors:
                    raise GGUFError(f"GGUF tensor {t.name!r} appears twice ({self.tensors[t.name].path.name}, {p.name})")
                shape = tuple(reversed(t.dims))
                gt = ggml_type(t.type_id, t.name)
                n_bytes = gt.row_bytes(shape[-1]) * math.prod(shape[:-1]) if shape else 0
                if t.offset + n_bytes > p.stat().st_size:
                    raise GGUFError(f"{p.name}: tensor {t.name!r} runs past the end of the file")
                self.tensors[t.name] = TensorInfo(t.name, gt, shape, p, t.offset, n_bytes, i)
        expected = self.value("split.tensors.count")
        if expected is not None and int(expected) != len(self.tensors):
            raise GGUFError(f"split GGUF {self.paths[0].name}: split.tensors.count is {expected}, "
                            f"the parts hold {len(self.tensors)} tensors")  # fmt: skip

    def _check_split(self) -> None:
        n = len(self.paths)
        for i, h in enumerate(self.headers):
            no, count = h.fields.get("split.no"), h.fields.get("split.count")
            if n == 1 and count in (None, 1):
                continue
            if (no, count) != (i, n):
                raise GGUFError(f"{self.paths[i].name}: split.no/split.count say {no}/{count}, "
                                f"expected part {i} of {n}")  # fmt: skip

    @property
    def architecture(self) -> str:
        arch = self.value("general.architecture")
        if arch is None:
            raise GGUFError(f"{self.paths[0].name} has no general.architecture")
        return arch

    def value(self, key: str, default: Any = None) -> Any:
        """A metadata value as a plain Python value (str, int, float, bool or list)."""
        return self.fields.get(key, default)

    def arch_value(self, key: str, default: Any = None) -> Any:
        """`<architecture>.<key>`."""
        return self.value(f"{self.architecture}.{key}", default)

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def info(self, name: str) -> TensorInfo:
        t = self.tensors.get(name)
        if t is None:
            raise GGUFError(f"{self.paths[0].name} has no tensor {name!r}")
        return t

    def raw(self, name: str) -> "torch.Tensor":
        """Tensor `name`'s bytes as uint8 [..., rows, row_bytes], a view into the mapping (no copy)."""
        import torch

        t = self.info(name)
        if self._maps[t.part] is None:
            self._maps[t.part] = np.memmap(t.path, dtype=np.uint8, mode="c")
        data = self._maps[t.part][t.offset : t.offset + t.n_bytes]
        return torch.from_numpy(data.reshape(t.byte_shape))

    def read(self, name: str, rows: slice | None = None) -> "torch.Tensor":
        """read_bytes as a torch tensor."""
        import torch

        return torch.from_numpy(self.read_bytes(name, rows))

    def read_bytes(self, name: str, rows: slice | None = None) -> np.ndarray:
        """A copy of tensor `name`'s bytes (uint8 [..., rows, row_bytes]), read with pread into new
        memory; rows: a range of its outermost dimension only."""
        t = self.info(name)
        shape = t.byte_shape
        start, stop = (0, shape[0]) if rows is None else rows.indices(shape[0])[:2]
        per = t.n_bytes // shape[0]
        out = np.empty((stop - start, *shape[1:]), dtype=np.uint8)
        view = memoryview(out).cast("B")
        with open(t.path, "rb", buffering=0) as f:
            got = os.preadv(f.fileno(), [view], t.offset + start * per)
        if got != view.nbytes:
            raise GGUFError(f"{t.path.name}: short read of tensor {name!r} ({got} of {view.nbytes} bytes)")
        return out

    def total_bytes(self) -> int:
        return sum(p.stat().st_size for p in self.paths)

