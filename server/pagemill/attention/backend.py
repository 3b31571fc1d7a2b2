"""The interface every attention implementation provides, and how one is picked.

Shapes: q [T, heads, head_dim], k/v [T, kv_heads, head_dim] (packed new
tokens), caches [num_blocks, block_size, kv_heads, head_dim] per layer.
Outputs are [T, heads, head_dim] in q's dtype.
"""

from __future__ import annotations

import importlib.util
from typing import Protocol

import torch

from pagemill.attention.metadata import AttentionMetadata

BACKEND_NAMES = ("auto", "torch", "flash", "triton")


class AttentionBackend(Protocol):
    name: str

    def write_kv(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        """Stores the new tokens' keys/values at their flat slots."""

    def prefill(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """Causal attention of the new tokens over cached prefix + themselves.

        Called after write_kv, so the cache already holds k/v of the new tokens.
        """

    def decode(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """One query token per sequence against its first context_lens keys."""


def select_backend(name: str, device: torch.device | str) -> AttentionBackend:
    """Returns the backend called `name` for `device`, or raises a clear error.

    "auto" is torch for now on every device; flash and triton arrive later and
    "auto" will prefer them on CUDA then.
    """
    device = torch.device(device)
    if name not in BACKEND_NAMES:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {', '.join(BACKEND_NAMES)}")
    if name in ("auto", "torch"):
        from pagemill.attention.torch_backend import TorchAttentionBackend

        return TorchAttentionBackend()
    package = {"flash": "flash_attn", "triton": "triton"}[name]
    if device.type != "cuda":
        raise RuntimeError(f"attention backend {name!r} needs a CUDA device, but the shard runs on {device.type!r}")
    if importlib.util.find_spec(package) is None:
        raise RuntimeError(f"attention backend {name!r} needs the {package!r} package, which is not installed")
    raise NotImplementedError(f"attention backend {name!r} is not implemented yet; use 'torch' or 'auto'")
