"""Building blocks of the Llama family: RMSNorm, rotary embedding, SwiGLU MLP.

Each mirrors the Hugging Face implementation operation for operation (same
dtype casts, same order), so that float32 logits agree to rounding error.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from pagemill.models.config import ModelConfig, RopeScaling
from pagemill.parallel.group import ParallelGroup
from pagemill.parallel.linear import ColumnParallelLinear, RowParallelLinear
from pagemill.parallel.partition import Range


class RMSNorm(nn.Module):
    kernel = None  # cpu_kernels.rowwise.NormKernel for bf16 rows on the CPU, set by pack_weights

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel is not None and self.kernel.applies(x, self.weight):
            return self.kernel(x, self.weight, self.eps)  # the arithmetic below, in one pass
        if x.dtype == torch.float32:
            # The same arithmetic as below in one fused kernel (fewer ops per
            # decode step; float32 needs none of the casts).
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # Normalise in float32, scale in the model dtype (as HF does).
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(residual + x, its norm): a decoder layer's residual add and the norm after it, in one
        kernel pass for bf16 CPU rows (the same bits as the add, rounded to bf16, then forward)."""
        k = self.kernel
        if k is not None and x.shape == residual.shape and k.applies(x, self.weight) \
                and k.applies(residual, self.weight):
            return k.add(x, residual, self.weight, self.eps)
        residual = residual + x
        return residual, self(residual)


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2], float32, on CPU."""
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    inv_freq = 1.0 / (theta**exponent)
    if scaling is None:
        return inv_freq
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    if scaling.rope_type == "longrope":
        # The short set; RotaryEmbedding switches to long_factor past the original context.
        return longrope_inv_freq(head_dim, theta, scaling.short_factor)
    # llama3: long wavelengths are divided by `factor`, short ones kept, the
    # band in between interpolated smoothly.
    old_len = scaling.original_max_position_embeddings
    low_freq_wavelen = old_len / scaling.low_freq_factor
    high_freq_wavelen = old_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def longrope_inv_freq(head_dim: int, theta: float, factors: tuple[float, ...]) -> torch.Tensor:
    """LongRoPE: each frequency divided by its own factor (transformers' operation order)."""
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    return 1.0 / (torch.tensor(factors, dtype=torch.float32, device="cpu") * theta**exponent)


class RotaryEmbedding:
    """cos/sin for arbitrary positions, computed per forward.

    Not an nn.Module on purpose: it has no weights to load. cos/sin are
    position * inv_freq, computed as HF computes them (bit for bit) and
    without a maximum length. On the CPU they are rows of a table computed
    the same way for positions [0, n), n doubling as positions grow: the
    same values, in one gather instead of six ops per forward (in a prefill
    step of 2048 tokens those ops each woke the OpenMP team; measured, ~2% of
    the shard's time in a 64-request burst). Elsewhere (CUDA graphs capture
    the forward, and a table size would need the positions on the host) they
    are computed per forward.

    LongRoPE (Phi-3) has two frequency sets. transformers picks one per forward
    call from its longest position: long_factor once max(position) + 1 exceeds
    original_max_position_embeddings (dynamic_rope_update). We pick per
    position by the same rule (position p uses long_factor iff p + 1 > original),
    so a cached key's rotation never changes with the batch it was computed in.
    This is exactly HF's cached generation whenever the prompt fits the
    original context (its prefill is all short, each later decode token is
    rotated by its own p + 1); a prompt already past it is rotated all-long
    by HF's prefill and short-then-long here.
    """

    def __init__(self, config: ModelConfig) -> None:
        scaling = config.rope_scaling
        self._inv_freq = rope_inv_freq(config.head_dim, config.rope_theta, scaling)
        self._long: torch.Tensor | None = None  # longrope's long set
        self._switch = 0  # first position that uses it
        self._attention = 1.0  # cos/sin multiplier (longrope's attention factor)
        if scaling is not None and scaling.rope_type == "longrope":
            self._long = longrope_inv_freq(config.head_dim, config.rope_theta, scaling.long_factor)
            self._switch = scaling.original_max_position_embeddings
            self._attention = scaling.attention_factor
        self._on_device: dict[torch.device, tuple[torch.Tensor, torch.Tensor | None]] = {}
        self._tables: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {}  # CPU: cos, sin [n, head_dim]

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, head_dim] in `dtype` for positions [T] (>= 0)."""
        if positions.device.type != "cpu" or positions.numel() == 0:
            return self._compute(positions, dtype)
        low, high = torch.aminmax(positions)
        table = self._tables.get(dtype)
        if low < 0:
            raise ValueError(f"rotary positions must be >= 0, got {int(low)}")
        if table is None or table[0].shape[0] <= high:
            n = max(1024, 1 << int(high).bit_length())
            table = self._tables[dtype] = self._compute(torch.arange(n), dtype)
        return table[0].index_select(0, positions), table[1].index_select(0, positions)

    def _compute(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        inv = self._on_device.get(positions.device)
        if inv is None:
            long = None if self._long is None else self._long.to(positions.device)
            inv = self._on_device[positions.device] = (self._inv_freq.to(positions.device), long)
        inv_freq, long = inv
        p = positions.float()[:, None]
        freqs = p * inv_freq  # [T, head_dim // 2]
        if long is not None:
            freqs = torch.where(p >= self._switch, p * long, freqs)
        emb = torch.cat((freqs, freqs), dim=-1)  # HF layout: both halves share a frequency
        if self._attention != 1.0:
            return (emb.cos() * self._attention).to(dtype), (emb.sin() * self._attention).to(dtype)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kernels=None) -> torch.Tensor:
    """x [T, heads, head_dim]; cos/sin [T, head_dim] (HF's rotate_half convention).
    kernels: cpu_kernels.rowwise.ElementwiseKernels, used for bf16 CPU rows in their layout (same roundings)."""
    if kernels is not None and kernels.applies(x) and x.stride(1) == x.shape[2] and cos.dtype == x.dtype \
            and cos.shape == (x.shape[0], x.shape[2]):
        return kernels.rotary(x, cos, sin)
    cos, sin = cos[:, None, :], sin[:, None, :]
    return x * cos + rotate_half(x) * sin


class MLP(nn.Module):
    # cpu_kernels.rowwise.ElementwiseKernels for bf16 rows on the CPU (silu(gate) * up in one pass), set by pack_weights
    kernels = None
    # (GemmBf16Kernel, interleaved packed gate_up, interleaved bias or None): gate_up and silu * up in one GEMM
    # (cpu_kernels/csrc/gemm/gemm_bf16.h's SwiGLU epilogue), set by pack_swiglu
    swiglu = None

    def __init__(
        self, config: ModelConfig, intermediate: Range | None = None, group: ParallelGroup | None = None
    ) -> None:
        """intermediate: the slice of the intermediate features this rank computes (all by default)."""
        super().__init__()
        h, bias = config.hidden_size, config.mlp_bias
        i = intermediate.size if intermediate is not None else config.intermediate_size
        self.intermediate_size = i
        # gate and up in one matmul (column-parallel: this rank's i features of
        # each); the loader fills rows [0, i) from the checkpoint's gate_proj and
        # [i, 2i) from up_proj. down_proj is row-parallel: one all-reduce.
        self.gate_up_proj = ColumnParallelLinear(h, 2 * i, bias=bias)
        self.down_proj = RowParallelLinear(i, h, bias, group or ParallelGroup.single())

    def pack_swiglu(self) -> bool:
        """Moves gate_up's packed copy for our bf16 GEMM to the interleaved one its SwiGLU epilogue
        reads: silu(gate) * up straight out of the GEMM, not a [rows, 2I] gate_up and a second pass
        (at a 2048-token prefill step the pass was ~3% of the step). Where gate_up runs our GEMM
        (AVX512-BF16) and I % 16 == 0; the plain weight stays for everything else. Call after
        gate_up is packed (PackedLinear.pack); re-packing gate_up later undoes it."""
        lin = self.gate_up_proj
        self.swiglu = None
        kernel = getattr(lin, "gemm", None)
        if kernel is None or not kernel.fast or self.intermediate_size % 16 or lin.in_features % 2 \
                or (lin.bias is not None and lin.bias.dtype != torch.bfloat16):
            return False  # fmt: skip
        from pagemill.cpu_kernels.gemm import interleave_swiglu, pack_swiglu

        bias = None if lin.bias is None else interleave_swiglu(lin.bias.detach()).contiguous()
        self.swiglu = (kernel, pack_swiglu(lin.weight), bias)
        lin.packed = lin.gemm = None  # the GEMM's copy now lives here (the same memory, reordered)
        return True

    def adapted(self) -> bool:
        """Whether this step adds adapters' products to gate_up's output (the SwiGLU epilogue
        would consume that output inside the GEMM, before they could be added)."""
        lora = getattr(self.gate_up_proj, "lora", None)
        return lora is not None and lora.active

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.swiglu is not None and x.dtype == torch.bfloat16 and x.dim() == 2 and x.shape[0] > 1 \
                and not (torch.is_grad_enabled() and x.requires_grad) and not self.adapted():
            kernel, packed, bias = self.swiglu  # (1 row: the matvec below reads the weight faster)
            rows_ok = x.stride(1) == 1 and x.stride(0) >= x.shape[1]
            return self.down_proj(kernel.swiglu(x if rows_ok else x.contiguous(), packed, bias))
        gate_up = self.gate_up_proj(x)
        if self.kernels is not None and gate_up.dim() == 2 and self.kernels.applies(gate_up):
            return self.down_proj(self.kernels.silu_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)
