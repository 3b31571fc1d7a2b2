"""Second KV tier stores: where blocks evicted from (or written through) the pool live.

A store maps a key (the router's chain hash of a block's whole token prefix,
seeded with the shard's namespace) to one block's K and V of every layer.
DiskStore keeps one file per block under --kv-offload-dir: versioned, with
the key, namespace, shape and a CRC32 of the payload in its header, so a
restarted shard indexes the directory at once and never serves a file that
is corrupt or belongs to another model/layout. MemoryStore keeps blocks in
host memory (pinned when the pool is on a GPU). Both enforce a byte budget
by evicting the least recently used keys and report every key they lose.

File writes run on a background thread: save() only copies the block to
host memory; a load of a key still being written is served from that copy.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import struct
import threading
import zlib
from collections import OrderedDict

import torch

log = logging.getLogger(__name__)

MAGIC = b"PMKV"
VERSION = 1
_PREFIX = struct.Struct("<4sHHI")  # magic, version, reserved, header length
SUFFIX = ".kv"


class StoreError(Exception):
    """A block that cannot be served: missing, corrupt, or written for something else."""


def encode(key: str, namespace: str, block: torch.Tensor) -> bytes:
    payload = block.contiguous().view(torch.uint8).numpy().tobytes()
    header = json.dumps({
        "key": key, "namespace": namespace, "dtype": str(block.dtype).removeprefix("torch."),
        "shape": list(block.shape), "nbytes": len(payload), "crc32": zlib.crc32(payload),
    }).encode()  # fmt: skip
    return _PREFIX.pack(MAGIC, VERSION, 0, len(header)) + header + payload


def read_header(f) -> dict:
    raw = f.read(_PREFIX.size)
    if len(raw) < _PREFIX.size:
        raise StoreError("truncated header")
    magic, version, _, n = _PREFIX.unpack(raw)
    if magic != MAGIC:
        raise StoreError("not a pagemill KV file")
    if version != VERSION:
        raise StoreError(f"format version {version}, expected {VERSION}")
    try:
        return json.loads(f.read(n))
    except ValueError:
        raise StoreError("unreadable header") from None


def decode(data: bytes, header: dict, key: str, namespace: str, shape, dtype: torch.dtype) -> torch.Tensor:
    """The block of a file, after every check; StoreError otherwise."""
    if header.get("key") != key or header.get("namespace") != namespace:
        raise StoreError("written for another key or model")
    if header.get("shape") != list(shape) or header.get("dtype") != str(dtype).removeprefix("torch."):
        raise StoreError(f"layout {header.get('shape')} {header.get('dtype')} does not match the pool")
    if len(data) != header.get("nbytes") or zlib.crc32(data) != header.get("crc32"):
        raise StoreError("checksum mismatch")
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dtype).reshape(shape)


class DiskStore:
    kind = "disk"

    def __init__(self, directory: str, budget_bytes: int, namespace: str, shape, dtype: torch.dtype) -> None:
        self.dir, self.namespace, self.shape, self.dtype = directory, namespace, tuple(shape), dtype
        self.block_bytes = len(encode("0" * 32, namespace, torch.zeros(self.shape, dtype=dtype)))
        self.capacity_blocks = max(0, budget_bytes // self.block_bytes)
        os.makedirs(directory, exist_ok=True)
        self._lock = threading.Lock()
        self._files: OrderedDict[str, None] = OrderedDict()  # least recently used first
        self._pending: dict[str, torch.Tensor] = {}  # saved, file not yet written
        self._lost: list[str] = []
        self._queue: queue.Queue = queue.Queue()
        self._scan()
        self._writer = threading.Thread(target=self._write_loop, name="pagemill-kv-writer", daemon=True)
        self._writer.start()

    def _path(self, key: str) -> str:
        return os.path.join(self.dir, key + SUFFIX)

    def _scan(self) -> None:
        """Indexes the files of this namespace, oldest first; skips the rest with a warning."""
        found = []
        for name in os.listdir(self.dir):
            if not name.endswith(SUFFIX):
                continue
            path, key = os.path.join(self.dir, name), name[: -len(SUFFIX)]
            try:
                with open(path, "rb") as f:
                    h = read_header(f)
                if h.get("namespace") != self.namespace:
                    continue  # another model's or layout's block: not ours to serve or delete
                if h.get("key") != key or h.get("shape") != list(self.shape):
                    raise StoreError("header does not match its name or the pool's layout")
                found.append((os.stat(path).st_mtime_ns, key))
            except (OSError, StoreError) as e:
                log.warning("KV tier: skipping %s: %s", path, e)
        for _, key in sorted(found):
            self._files[key] = None
        self.trim()
        log.info("KV tier: %d blocks found in %s", len(self._files), self.dir)

    def keys(self) -> list[str]:
        with self._lock:
            return list(self._files)

    def save(self, key: str, block: torch.Tensor) -> None:
        """block: a host copy the caller no longer touches."""
        with self._lock:
            self._files[key] = None
            self._files.move_to_end(key)
            self._pending[key] = block
        self._queue.put((key, block))

    def load(self, key: str) -> torch.Tensor:
        with self._lock:
            if key not in self._files:
                raise StoreError("not stored")
            self._files.move_to_end(key)
            pending = self._pending.get(key)
        if pending is not None:
            return pending
        try:
            with open(self._path(key), "rb") as f:
                header = read_header(f)
                block = decode(f.read(), header, key, self.namespace, self.shape, self.dtype)
        except (OSError, StoreError) as e:
            log.warning("KV tier: not serving %s: %s", key, e)
            self.delete(key)
            with self._lock:
                self._lost.append(key)
            raise StoreError(str(e)) from None
        os.utime(self._path(key), None)  # recency survives a restart
        return block

    def delete(self, key: str) -> None:
        with self._lock:
            self._files.pop(key, None)
            self._pending.pop(key, None)
            self._remove(key)

    def take_lost(self) -> list[str]:
        with self._lock:
            lost, self._lost = self._lost, []
        return lost

    def flush(self) -> None:
        """Waits for every queued write (tests, warmup measurement)."""
        self._queue.join()

    def _remove(self, key: str) -> None:
        try:
            os.remove(self._path(key))
        except FileNotFoundError:
            pass

    def trim(self) -> None:
        """Evicts least recently used blocks beyond the budget. Run after a step's ops, not
        per save: the router's deletes bring a step back within budget first."""
        with self._lock:
            while len(self._files) > self.capacity_blocks:
                key, _ = self._files.popitem(last=False)
                self._pending.pop(key, None)
                self._remove(key)
                self._lost.append(key)

    def _write_loop(self) -> None:
        while True:
            key, block = self._queue.get()
            try:
                self._write(key, block)
            except OSError as e:
                log.warning("KV tier: cannot write %s: %s", key, e)
                self.delete(key)
                with self._lock:
                    self._lost.append(key)
            finally:
                self._queue.task_done()

    def _write(self, key: str, block: torch.Tensor) -> None:
        with self._lock:
            if self._pending.get(key) is not block:
                return  # deleted, evicted or saved again since
        data = encode(key, self.namespace, block)
        tmp = self._path(key) + f".{threading.get_ident()}.tmp"
        with open(tmp, "wb") as f:
            f.write(data)
        with self._lock:
            if self._pending.get(key) is block:
                os.replace(tmp, self._path(key))  # a reader sees the old file or the whole new one
                del self._pending[key]
                return
        os.remove(tmp)


class MemoryStore:
    """Host memory behind a GPU pool (or a CPU one, for tests): nothing persists."""

    kind = "memory"

    def __init__(self, budget_bytes: int, shape, dtype: torch.dtype, pin: bool) -> None:
        self.shape, self.dtype, self.pin = tuple(shape), dtype, pin
        self.block_bytes = torch.zeros(self.shape, dtype=dtype).nbytes
        self.capacity_blocks = max(0, budget_bytes // self.block_bytes)
        self._blocks: OrderedDict[str, torch.Tensor] = OrderedDict()
        self._lost: list[str] = []

    def keys(self) -> list[str]:
        return list(self._blocks)

    def save(self, key: str, block: torch.Tensor) -> None:
        self._blocks[key] = block
        self._blocks.move_to_end(key)

    def trim(self) -> None:
        while len(self._blocks) > self.capacity_blocks:
            self._lost.append(self._blocks.popitem(last=False)[0])

    def load(self, key: str) -> torch.Tensor:
        block = self._blocks.get(key)
        if block is None:
            raise StoreError("not stored")
        self._blocks.move_to_end(key)
        return block

    def delete(self, key: str) -> None:
        self._blocks.pop(key, None)

    def take_lost(self) -> list[str]:
        lost, self._lost = self._lost, []
        return lost

    def flush(self) -> None:
        pass
