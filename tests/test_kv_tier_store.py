"""The second KV tier's stores and ops (shard/kv_store.py, shard/kv_tier.py): a saved block
comes back bit for bit; a corrupt, truncated, renamed or other-model file is never served;
a restarted store finds what the last one wrote; the byte budget evicts least recently used
blocks and says which."""

from __future__ import annotations

import os

import pytest
import torch

from pagemill.proto import pb
from pagemill.shard.kv_pool import KVPool
from pagemill.shard.kv_store import DiskStore, MemoryStore, StoreError
from pagemill.shard.kv_tier import block_shape, run_ops

SHAPE = (2, 2, 4, 3, 8)  # layers, K/V, block_size, kv heads, head dim
NS = "ns-a"


def key(i: int) -> str:
    return f"{i:032x}"


def block(seed: int, dtype=torch.bfloat16) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(SHAPE, generator=g).to(dtype)


def disk(tmp_path, blocks: int = 16, ns: str = NS, dtype=torch.bfloat16) -> DiskStore:
    probe = DiskStore(str(tmp_path / "probe"), 0, ns, SHAPE, dtype)
    return DiskStore(str(tmp_path / "kv"), blocks * probe.block_bytes, ns, SHAPE, dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float8_e4m3fn])
def test_roundtrip_is_bit_exact_in_memory_and_on_disk(tmp_path, dtype):
    s = disk(tmp_path, dtype=dtype)
    b = block(1, dtype)
    s.save(key(1), b.clone())
    assert s.load(key(1)).view(torch.uint8).equal(b.view(torch.uint8))  # while the write is pending
    s.flush()
    # A fresh store over the same directory: what a restarted shard sees.
    again = disk(tmp_path, dtype=dtype)
    assert again.keys() == [key(1)]
    assert again.load(key(1)).view(torch.uint8).equal(b.view(torch.uint8))


def _file(s: DiskStore, k: str) -> str:
    return os.path.join(s.dir, k + ".kv")


def test_corrupt_payload_is_rejected_and_reported_lost(tmp_path):
    s = disk(tmp_path)
    s.save(key(1), block(1))
    s.flush()
    path = _file(s, key(1))
    data = bytearray(open(path, "rb").read())
    data[-5] ^= 0xFF
    open(path, "wb").write(bytes(data))
    with pytest.raises(StoreError, match="checksum"):
        s.load(key(1))
    assert s.take_lost() == [key(1)]
    assert key(1) not in s.keys() and not os.path.exists(path)


def test_truncated_and_foreign_files_are_skipped_at_scan(tmp_path, caplog):
    s = disk(tmp_path)
    for i in range(3):
        s.save(key(i), block(i))
    s.flush()
    open(_file(s, key(0)), "r+b").truncate(3)  # header cut short
    os.rename(_file(s, key(1)), _file(s, key(9)))  # a file whose header names another key
    other = disk(tmp_path / "x", ns="ns-b")  # another model's block in the same directory
    other.save(key(5), block(5))
    other.flush()
    os.replace(_file(other, key(5)), _file(s, key(5)))
    with caplog.at_level("WARNING"):
        again = disk(tmp_path)
    assert again.keys() == [key(2)]
    assert "skipping" in caplog.text


def test_mismatched_key_version_or_layout_is_not_served(tmp_path):
    s = disk(tmp_path)
    s.save(key(1), block(1))
    s.save(key(2), block(2))
    s.flush()
    os.replace(_file(s, key(2)), _file(s, key(1)))  # key(1)'s name, key(2)'s content
    with pytest.raises(StoreError, match="another key"):
        s.load(key(1))
    s.save(key(3), block(3))
    s.flush()
    data = bytearray(open(_file(s, key(3)), "rb").read())
    data[4] = 99  # format version
    open(_file(s, key(3)), "wb").write(bytes(data))
    with pytest.raises(StoreError, match="version"):
        s.load(key(3))
    s.save(key(4), block(4))
    s.flush()
    wide = DiskStore(s.dir, 1 << 30, NS, (2, 2, 4, 3, 16), torch.bfloat16)  # another pool layout
    assert key(4) not in wide.keys()


def test_budget_evicts_least_recently_used(tmp_path):
    s = disk(tmp_path, blocks=3)
    for i in range(3):
        s.save(key(i), block(i))
    s.load(key(0))  # now the most recent
    s.save(key(3), block(3))
    s.trim()
    assert s.take_lost() == [key(1)]
    assert s.keys() == [key(2), key(0), key(3)]
    s.flush()
    assert sorted(os.listdir(s.dir)) == sorted(k + ".kv" for k in (key(0), key(2), key(3)))
    with pytest.raises(StoreError):
        s.load(key(1))


def test_memory_store_budget_and_roundtrip():
    s = MemoryStore(2 * block(0).nbytes, SHAPE, torch.bfloat16, pin=False)
    for i in range(3):
        s.save(key(i), block(i))
    s.trim()
    assert s.take_lost() == [key(0)]
    assert s.load(key(2)).equal(block(2))
    with pytest.raises(StoreError):
        s.load(key(0))


def test_ops_save_before_loads_reuse_the_block(tmp_path):
    """A step that evicts block 1 and hands it out again for a load: the save copies the old
    content out first, the load then fills the block; a failed load is reported."""
    pool = KVPool(num_blocks=4, block_size=4, storage=torch.zeros((2, 2, 4, 4, 3, 8), dtype=torch.bfloat16))
    assert block_shape(pool) == SHAPE
    s = disk(tmp_path)
    s.save(key(7), block(7))
    pool.storage[:, :, 1] = block(1)
    req = pb.StepRequest(
        kv_saves=[pb.KvSave(block_id=1, key=key(1))],
        kv_loads=[pb.KvLoad(key=key(7), block_id=1), pb.KvLoad(key=key(8), block_id=2)],
        kv_deletes=[key(7)],
    )
    out = run_ops(s, pool, req)
    assert out.failed_loads == [key(8)]
    assert pool.storage[:, :, 1].equal(block(7))
    assert s.load(key(1)).equal(block(1))
    assert key(7) not in s.keys()
