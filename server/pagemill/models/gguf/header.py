"""A GGUF file's header: its metadata and the table of its tensors, read in one pass.

gguf-py's GGUFReader builds a numpy view per element of every metadata array; a 262144-token
vocabulary (Gemma 3) is three such arrays, and opening that file took it minutes on a loaded
2-core machine. This reads the same header (GGUF v2/v3, little-endian, as GGUFReader reads it:
the tests compare both on every file they write) with one bytes read per string and one
np.frombuffer per numeric array, and maps the tensor data with numpy, copy-on-write.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from pagemill.models.gguf.types import GGUFError

GGUF_MAGIC = b"GGUF"
# GGUFValueType -> (struct format, numpy dtype) for the fixed-size ones.
_SCALARS = {0: ("<B", np.uint8), 1: ("<b", np.int8), 2: ("<H", np.uint16), 3: ("<h", np.int16),
            4: ("<I", np.uint32), 5: ("<i", np.int32), 6: ("<f", np.float32), 7: ("<?", np.bool_),
            10: ("<Q", np.uint64), 11: ("<q", np.int64), 12: ("<d", np.float64)}  # fmt: skip
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class TensorEntry:
    name: str
    dims: tuple[int, ...]  # as the file lists them: fastest-varying first
    type_id: int
    offset: int  # absolute, in the file


@dataclass
class Header:
    version: int
    fields: dict[str, Any]
    tensors: list[TensorEntry]
    data_offset: int


class _Stream:
    def __init__(self, f: BinaryIO, path: Path) -> None:
        self.f, self.path = f, path

    def take(self, n: int) -> bytes:
        b = self.f.read(n)
        if len(b) != n:
            raise GGUFError(f"{self.path.name}: truncated GGUF header")
        return b

    def scalar(self, vtype: int) -> Any:
        fmt = _SCALARS[vtype][0]
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        return self.take(self.scalar(10)).decode("utf-8", errors="replace")

    def value(self, vtype: int) -> Any:
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            item, n = self.scalar(4), self.scalar(10)
            if item == _STRING:
                return [self.string() for _ in range(n)]
            if item in _SCALARS:
                dtype = np.dtype(_SCALARS[item][1]).newbyteorder("<")
                return np.frombuffer(self.take(n * dtype.itemsize), dtype=dtype).tolist()
            return [self.value(item) for _ in range(n)]  # arrays of arrays
        if vtype in _SCALARS:
            v = self.scalar(vtype)
            return float(v) if vtype in (6, 12) else v
        raise GGUFError(f"{self.path.name}: unknown GGUF metadata value type {vtype}")


def read_header(path: Path) -> Header:
    with open(path, "rb") as f:
        s = _Stream(f, path)
        if s.take(4) != GGUF_MAGIC:
            raise GGUFError(f"{path.name} is not a GGUF file (bad magic)")
        version = s.scalar(4)
        if version not in (2, 3):
            raise GGUFError(f"{path.name}: GGUF version {version} is not supported (2 and 3 are)")
        n_tensors, n_kv = s.scalar(10), s.scalar(10)
        fields: dict[str, Any] = {}
        for _ in range(n_kv):
            key = s.string()
            fields[key] = s.value(s.scalar(4))
        infos = []
        for _ in range(n_tensors):
            name = s.string()
            dims = tuple(s.scalar(10) for _ in range(s.scalar(4)))
            infos.append((name, dims, s.scalar(4), s.scalar(10)))
        align = int(fields.get("general.alignment", 32))
        if align <= 0 or align & (align - 1):
            raise GGUFError(f"{path.name}: general.alignment {align} is not a power of two")
        start = -(-f.tell() // align) * align
    return Header(version, fields, [TensorEntry(n, d, t, start + o) for n, d, t, o in infos], start)
