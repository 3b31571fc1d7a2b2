"""The tensor-parallel process group of one shard process.

Every rank of a group runs the same forward on the same inputs and meets the
others at the same collectives, in the same order. That order is guaranteed
by the router: its scheduler is one task that awaits each Warmup / Step
fan-out before sending the next, and each shard serialises model calls
behind one lock. Health/Info never communicate.

A ParallelGroup of world_size 1 performs no communication at all, so the
unsharded model keeps its exact single-process arithmetic.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from datetime import timedelta

import torch

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ParallelConfig:
    rank: int = 0
    world_size: int = 1
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    # A rank that dies mid-forward leaves the others blocked in a collective;
    # after this long they fail the call (and Health) instead of hanging forever.
    # Ranks meet once per layer, so only a lost peer waits anywhere near this long.
    timeout_s: float = 300.0


class ParallelGroup:
    """Collectives over the shard's device: gloo for CPU tensors, NCCL for CUDA ones."""

    def __init__(self, rank: int, world_size: int, device: torch.device | str, initialised: bool) -> None:
        self.rank, self.world_size = rank, world_size
        self.device = torch.device(device)
        self._initialised = initialised  # we called init_process_group (and must destroy it)

    @classmethod
    def single(cls, device: torch.device | str = "cpu") -> "ParallelGroup":
        return cls(0, 1, device, initialised=False)

    @classmethod
    def init(cls, cfg: ParallelConfig, device: torch.device | str) -> "ParallelGroup":
        """Joins (or, on rank 0, hosts) the TCP rendezvous at master_addr:master_port."""
        device = torch.device(device)
        if not 0 <= cfg.rank < cfg.world_size:
            raise ValueError(f"rank {cfg.rank} is outside world_size {cfg.world_size}")
        if cfg.world_size == 1:
            return cls.single(device)
        import torch.distributed as dist

        backend = "nccl" if device.type == "cuda" else "gloo"
        if device.type == "cuda":
            torch.cuda.set_device(device)  # NCCL binds its communicator to the current device
        log.info("rank %d/%d: joining %s group at %s:%d", cfg.rank, cfg.world_size, backend,
                 cfg.master_addr, cfg.master_port)  # fmt: skip
        dist.init_process_group(
            backend,
            init_method=f"tcp://{cfg.master_addr}:{cfg.master_port}",
            rank=cfg.rank,
            world_size=cfg.world_size,
            timeout=timedelta(seconds=cfg.timeout_s),
        )
        return cls(cfg.rank, cfg.world_size, device, initialised=True)

    def barrier(self) -> None:
        if self.world_size > 1:
            import torch.distributed as dist

            dist.barrier()

    def destroy(self) -> None:
        if self._initialised:
            import torch.distributed as dist

            dist.destroy_process_group()
            self._initialised = False

    # --- collectives (no-ops for one rank) -------------------------------------------

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sums t over ranks, in place; returns t. Every rank ends with the same bits."""
        if self.world_size > 1:
            import torch.distributed as dist

            dist.all_reduce(t)
        return t

    def all_gather(self, t: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenates every rank's t (same shape on all ranks) along dim, in rank order."""
        if self.world_size == 1:
            return t
        import torch.distributed as dist

        t = t.contiguous()
        parts = [torch.empty_like(t) for _ in range(self.world_size)]
        dist.all_gather(parts, t)
        return torch.cat(parts, dim=dim)

    def all_reduce_min(self, value: int) -> int:
        if self.world_size == 1:
            return value
        import torch.distributed as dist

        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return int(t.item())

    def broadcast_int(self, value: int, src: int = 0) -> int:
        """src's value on every rank."""
        if self.world_size == 1:
            return value
        import torch.distributed as dist

        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        dist.broadcast(t, src=src)
        return int(t.item())

    def shared_seed(self) -> int | None:
        """A random seed, the same on every rank (None for one rank: let torch seed).

        The sampler's generator for unseeded requests must draw identically on all
        ranks, or their cached batches would diverge (each rank appends its own
        sampled token; the router only reads rank 0's).
        """
        if self.world_size == 1:
            return None
        return self.broadcast_int(int.from_bytes(os.urandom(8), "little") >> 2)  # fits int64


def rank_device(device: str, rank: int, world_size: int, local_rank: int | None) -> torch.device:
    """The device of one rank: with several CUDA ranks, each takes its own GPU
    (LOCAL_RANK when a multi-node launcher gives one, else rank modulo the GPUs
    visible) unless the device string names one already."""
    dev = torch.device(device)
    if dev.type != "cuda" or dev.index is not None or world_size == 1:
        return dev
    index = local_rank if local_rank is not None else rank % max(1, torch.cuda.device_count())
    return torch.device("cuda", index)
