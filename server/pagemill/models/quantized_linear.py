"""int8 weights for the CPU shard (`--quantize int8`).

Every linear of the decoder layers (q/k/v, o, gate/up, down) and the output
head is replaced after loading by a QuantizedLinear: symmetric int8 weights
per output channel, activations quantized to int8 per row (token) on every
call, products summed in int32 and scaled back to the model dtype
(cpu_kernels/csrc/int8/int8_linear.cpp, AVX512-VNNI where the CPU has it). Norms,
rotary, attention, the KV cache and the embedding lookup stay in the
configured --dtype.

The input of down_proj (SiLU(gate) * up) has a few channels far larger than
the rest, and one scale per token then rounds most of the row to a handful of
levels: on SmolLM2-135M this alone cost most of int8's perplexity increase
(docs/quantization.md). As in QuaRot, that linear computes
y = (W H^T / b) (H x) instead, H the b x b Walsh-Hadamard matrix applied per
block of b input features (b the largest power of two up to 512 dividing K):
H spreads each outlier over b channels before quantizing, W H^T / b is
rotated once at load, and the kernel applies H to each row by butterflies
(K log b additions, nothing next to the product).

Why the output head too: SmolLM2-135M's tied 49152 x 576 head is a fifth of
the model's weights, so a float head would keep most of a batch-1 step's
bytes (see docs/quantization.md for the quality measured with and without).
The embedding keeps its float weight for the lookup; the head gets its own
int8 copy.

Only on the CPU and without tensor parallelism: the GPU
paths and the row-parallel all-reduce were not written for it (config.check_quantize). At
small batch the fused whole-layer decode (fused_decode.py) reads the packed
tensors below through raw pointers with the same arithmetic (int8_rows.h);
the module path runs prefill, larger batches and `--no-cpu-kernels`.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from pagemill.cpu_kernels.int8 import BLOCK_N, GROUP_K, Int8LinearKernel
from pagemill.models.packed_linear import PackedLinear

log = logging.getLogger(__name__)

def quantize_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] float -> (int8 [N, K], float32 scale [N]) with w ~= scale[:, None] * q."""
    w = w.detach().float()
    amax = w.abs().amax(dim=1)
    scale = amax / 127
    q = torch.round(w / torch.where(amax > 0, scale, 1)[:, None]).clamp_(-127, 127)
    return q.to(torch.int8), scale


MAX_ROTATE = 512


def rotation_block(k: int) -> int:
    """Hadamard block for a K-feature input: the largest power of two <= MAX_ROTATE dividing k
    (0 below 16: too small to spread anything)."""
    b = 1
    while b < MAX_ROTATE and k % (2 * b) == 0:
        b *= 2
    return b if b >= 16 else 0


def hadamard(b: int) -> torch.Tensor:
    """The unnormalized b x b Walsh-Hadamard matrix (Sylvester; symmetric, H H = b I), float64."""
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < b:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


def rotate_weight(w: torch.Tensor, b: int) -> torch.Tensor:
    """W [N, K] -> W H^T / b per block of b input features (float64 inside), so that
    rotated(W) @ (H x) = W @ x."""
    n, k = w.shape
    return ((w.double().view(n, k // b, b) @ hadamard(b)) / b).view(n, k).to(w.dtype)


def fwht_rows(x: torch.Tensor, b: int) -> torch.Tensor:
    """x [M, K] float32 -> H x per block of b: the kernel's butterflies, same additions in the
    same order (bitwise equal results)."""
    m, k = x.shape
    v = x.float().reshape(m * (k // b), b)
    h = 1
    while h < b:
        v = v.view(-1, b // (2 * h), 2, h)
        p, q = v[:, :, 0], v[:, :, 1]
        v = torch.stack((p + q, p - q), dim=2).view(-1, b)
        h *= 2
    return v.view(m, k)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's activation quantization in torch: x [M, K] -> (int8 [M, K], float32 scale [M])."""
    x = x.float()
    amax = x.abs().amax(dim=1, keepdim=True)
    q = torch.round(x * (127 / torch.where(amax > 0, amax, 1))).clamp_(-127, 127)
    return q.to(torch.int8), (amax / 127)[:, 0]


def pack_int8(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 [N, K] -> (the kernel's layout [N/16, K/4, 16, 4] with N, K padded, int32
    128 * row sums [N padded]) (int8_linear.cpp says why both)."""
    n, k = q.shape
    np_, kp = -(-n // BLOCK_N) * BLOCK_N, -(-k // GROUP_K) * GROUP_K
    padded = F.pad(q, (0, kp - k, 0, np_ - n))
    packed = padded.view(np_ // BLOCK_N, BLOCK_N, kp // GROUP_K, GROUP_K).permute(0, 2, 1, 3).contiguous()
    corr = 128 * padded.to(torch.int32).sum(dim=1, dtype=torch.int32)
    return packed, corr


def unpack_int8(packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """Inverse of pack_int8's layout: -> int8 [n, k]."""
    blocks, k4s = packed.shape[:2]
    return packed.permute(0, 2, 1, 3).reshape(blocks * BLOCK_N, k4s * GROUP_K)[:n, :k]


def reference_int8_linear(x: torch.Tensor, q: torch.Tensor, w_scale: torch.Tensor,
                          bias: torch.Tensor | None, rotate: int = 0) -> torch.Tensor:  # fmt: skip
    """The kernel's arithmetic in torch (float32 result): rows rotated (rotate > 0), int8 rows x
    int8 weights summed exactly (float64 holds every int32 sum), then scaled. Used without a
    compiler and as the tests' reference."""
    xq, x_scale = quantize_rows(fwht_rows(x, rotate) if rotate else x)
    acc = (xq.double() @ q.double().T).float()
    y = acc * (x_scale[:, None] * w_scale[None, :])
    return y if bias is None else y + bias


class QuantizedLinear(nn.Module):
    """A linear with int8 weights; forward takes and returns the model dtype."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, kernel: Int8LinearKernel | None,
                 rotate: int = 0) -> None:  # fmt: skip
        """rotate: Hadamard block applied to the inputs (0: none; see the module docstring)."""
        super().__init__()
        self.out_features, self.in_features = weight.shape
        if rotate and (rotate & (rotate - 1) or self.in_features % rotate):
            raise ValueError(f"rotate={rotate} is not a power of two dividing in_features={self.in_features}")
        self.rotate = rotate
        q, scale = quantize_weight(rotate_weight(weight.detach().float(), rotate) if rotate else weight)
        self.kernel = kernel
        n_pad = -(-self.out_features // BLOCK_N) * BLOCK_N
        # A parameter (int8), not a buffer: fused_decode tells int8 layers by it.
        if kernel is not None:
            packed, corr = pack_int8(q)
            self.qweight = nn.Parameter(packed, requires_grad=False)
            self.register_buffer("w_corr", corr)
        else:
            self.qweight = nn.Parameter(q, requires_grad=False)
            self.register_buffer("w_corr", None)
        # Padded with zeros to the kernel's 16-channel blocks (it loads whole blocks).
        self.register_buffer("w_scale", F.pad(scale, (0, n_pad - self.out_features)))
        self.register_buffer("bias", None if bias is None else bias.detach().float().contiguous())

    def int8_weight(self) -> torch.Tensor:
        """The int8 weight [out, in] (unpacked view where packed; rotated where rotate > 0)."""
        if self.kernel is None:
            return self.qweight
        return unpack_int8(self.qweight, self.out_features, self.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead, dtype = x.shape[:-1], x.dtype
        rows = x.reshape(-1, self.in_features)
        if rows.dtype not in (torch.float32, torch.bfloat16):
            rows = rows.float()  # float16: the kernel reads float32 or bfloat16
        if self.kernel is not None:
            y = self.kernel(rows.contiguous(), self.qweight, self.w_scale, self.w_corr, self.bias, self.out_features,
                            self.rotate)  # fmt: skip
        else:
            y = reference_int8_linear(rows, self.qweight, self.w_scale[: self.out_features], self.bias, self.rotate)
        return y.to(dtype).reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        path = "reference (torch)" if self.kernel is None else ("vnni" if self.kernel.vnni else "portable")
        rot = f", hadamard {self.rotate}" if self.rotate else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, int8{rot}, {path}"


def quantize_model(model: nn.Module, cpu_kernels: bool = True, lm_head: bool = True, rotate_down: bool = True,
                   kernel: Int8LinearKernel | None = None) -> int:  # fmt: skip
    """Replaces the decoder's linears (and with lm_head the output head) by QuantizedLinears;
    returns how many. cpu_kernels=False (or no compiler) computes the same arithmetic in torch.
    rotate_down: Hadamard-rotate down_proj's inputs (the default; off only to measure it).
    kernel: the compiled kernel to use (default: the process-wide one)."""
    if kernel is None and cpu_kernels:
        from pagemill.cpu_kernels.int8 import int8_kernel

        kernel = int8_kernel()
    targets = [(name, m) for name, m in model.named_modules() if isinstance(m, PackedLinear)
               and (lm_head or name != "lm_head")]  # fmt: skip
    for name, m in targets:
        parent_name, _, leaf = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        rotate = rotation_block(m.in_features) if rotate_down and name.endswith("mlp.down_proj") else 0
        setattr(parent, leaf, QuantizedLinear(m.weight, m.bias, kernel, rotate))
    if kernel is None:
        path = "torch reference"
    elif not kernel.vnni:
        path = "portable C++"
    else:
        path = "AMX-INT8 (8+ rows) and AVX512-VNNI" if kernel.amx else "AVX512-VNNI"
    log.info("quantize int8: %d linears (output head %s), %s kernel", len(targets),
             "included" if lm_head else "kept in the model dtype", path)  # fmt: skip
    return len(targets)
