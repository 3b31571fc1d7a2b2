"""The interface every attention implementation provides, and how one is picked.

Shapes: q [T, heads, head_dim], k/v [T, kv_heads, head_dim] (packed new
tokens), caches [num_blocks, block_size, kv_heads, head_dim] per layer.
Outputs are [T, heads, head_dim] in q's dtype.
"""

from __future__ import annotations

import importlib.util
import logging
from typing import Protocol

import torch

from pagemill.attention.metadata import AttentionMetadata

BACKEND_NAMES = ("auto", "torch", "flash", "triton")

log = logging.getLogger(__name__)
_LOGGED: set[str] = set()  # auto logs each distinct choice once per process


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
        window: int | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        """Causal attention of the new tokens over cached prefix + themselves.

        Called after write_kv, so the cache already holds k/v of the new tokens.
        window: the layer's sliding window (None: global): the new token at
        position p sees keys p - window + 1 .. p, as transformers' sliding mask.
        softcap: scores become softcap * tanh(scores / softcap) before the
        softmax (Gemma 2's attention-logit capping; None: none).
        """

    def decode(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        window: int | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        """One query token per sequence against its first context_lens keys (the last `window` of
        them for a sliding-window layer); softcap as prefill."""


def select_backend(name: str, device: torch.device | str, cpu_kernels: bool = False) -> AttentionBackend:
    """Returns the backend called `name` for `device`, or raises a clear error naming what is missing.

    "auto" takes flash, else triton on CUDA, and torch everywhere else.
    cpu_kernels: on the CPU, the torch backend's float32 decode runs the compiled paged kernel.
    """
    device = torch.device(device)
    if name not in BACKEND_NAMES:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {', '.join(BACKEND_NAMES)}")
    if name == "torch":
        return _torch(device, cpu_kernels)
    if name == "flash":
        return _flash(device)
    if name == "triton":
        return _triton(device)
    chosen, why = None, f"the shard runs on {device.type!r}"
    if device.type == "cuda":
        skipped = []
        for make in (_flash, _triton):
            try:
                chosen = make(device)
                break
            except RuntimeError as e:
                skipped.append(str(e))
        why = "; ".join(skipped) or "flash-attn is available"
    chosen = chosen or _torch(device, cpu_kernels)
    message = f"attention backend: auto chose {chosen.name!r} ({why})"
    if message not in _LOGGED:
        _LOGGED.add(message)
        log.info(message)
    return chosen


def _torch(device: torch.device, cpu_kernels: bool) -> AttentionBackend:
    from pagemill.attention.torch_backend import TorchAttentionBackend

    if cpu_kernels and device.type == "cpu":
        from pagemill.cpu_kernels.decode import decode_kernels

        return TorchAttentionBackend(decode_kernels())
    return TorchAttentionBackend()


def _missing_cuda(device: torch.device) -> str | None:
    if device.type != "cuda":
        return f"a CUDA device (the shard runs on {device.type!r})"
    if not torch.cuda.is_available():
        return "a CUDA device (torch.cuda.is_available() is False)"
    return None


def _triton(device: torch.device) -> AttentionBackend:
    if importlib.util.find_spec("triton") is None:
        raise RuntimeError("attention backend 'triton' needs the 'triton' package, which is not installed")
    import triton

    cuda = _missing_cuda(device)
    # The interpreter runs the same kernels on CPU tensors: for debugging, far too slow to serve.
    if cuda is not None and not triton.knobs.runtime.interpret:
        raise RuntimeError(f"attention backend 'triton' needs {cuda}, or TRITON_INTERPRET=1 to run its kernels "
                           "in Triton's CPU interpreter")  # fmt: skip
    from pagemill.attention.triton_backend import TritonAttentionBackend

    return TritonAttentionBackend(device)


def _flash(device: torch.device) -> AttentionBackend:
    missing = [m for m in (_missing_cuda(device),) if m]
    try:
        import flash_attn
    except (ImportError, OSError) as e:  # OSError: installed but built against another torch/CUDA
        missing.append(f"the flash-attn package (import flash_attn failed: {e})")
    if missing:
        raise RuntimeError(f"attention backend 'flash' needs {' and '.join(missing)}")
    from pagemill.attention.flash_backend import FlashAttentionBackend

    # KV writes and what flash-attn cannot page (small blocks, float32) run on Triton.
    return FlashAttentionBackend(flash_attn, _triton(device))
