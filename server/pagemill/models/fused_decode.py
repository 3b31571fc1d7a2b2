"""Single-token decode through the compiled whole-layer kernel (cpu_kernels/decode.cpp).

Why: at batch 1 on the CPU a decode step is a stream over the weights, and
the ~25 small torch ops per layer around the linears (norms, rotary, KV
write and gather, SDPA, SiLU, residual adds) cost about as much dispatch
time as the weights take to read. The kernel runs a layer in one call.

It applies only where it computes exactly what the torch path does: CPU,
float32 weights, pool and activations, one unsharded process (no
all-reduce between the halves of a layer), one sequence with one new token
(not prefill, not speculative verification). Everything else, and
`--no-cpu-kernels`, takes the module path. The layer's parameters are read
through pointers taken at pack time: a model whose parameters are replaced
afterwards must be packed again (as for packed_linear's copies); the
tensors are held here, so a stale table never points at freed memory.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from pagemill.attention.metadata import AttentionMetadata
from pagemill.cpu_kernels import DecodeKernels

KVCache = tuple[torch.Tensor, torch.Tensor]


class FusedDecoder:
    def __init__(self, layers: nn.ModuleList, kernels: DecodeKernels, eps: float, block_size_hint: int = 0) -> None:
        self._kernels = kernels
        self._eps = eps
        first = layers[0]
        attn, mlp = first.self_attn, first.mlp
        self._scale = attn.scale
        self._dims_base = [first.input_layernorm.weight.shape[0], attn.num_heads, attn.num_kv_heads, attn.head_dim,
                           mlp.intermediate_size]  # fmt: skip
        self._dims: dict[int, torch.Tensor] = {}  # block_size -> dims table
        self._held: list[torch.Tensor] = []
        self._tables = [self._pointer_table(layer) for layer in layers]

    @classmethod
    def build(cls, model: nn.Module, kernels: DecodeKernels | None) -> "FusedDecoder | None":
        """The decoder for `model` (a LlamaForCausalLM), or None where the kernel does not apply."""
        if kernels is None or model.group.world_size != 1:
            return None
        layers = model.model.layers
        params = [p for layer in layers for p in layer.parameters()]
        if not params or any(p.device.type != "cpu" or p.dtype != torch.float32 or not p.is_contiguous()
                             for p in params):  # fmt: skip
            return None
        if model.config.head_dim % 2 or len({layer.input_layernorm.eps for layer in layers}) != 1:
            return None
        return cls(layers, kernels, layers[0].input_layernorm.eps)

    def _pointer_table(self, layer: nn.Module) -> torch.Tensor:
        attn, mlp = layer.self_attn, layer.mlp
        tensors = [layer.input_layernorm.weight, attn.qkv_proj.weight, attn.qkv_proj.bias, attn.o_proj.weight,
                   layer.post_attention_layernorm.weight, mlp.gate_up_proj.weight, mlp.gate_up_proj.bias,
                   mlp.down_proj.weight, mlp.down_proj.bias]  # fmt: skip
        assert len(tensors) == self._kernels.layer_ptrs
        self._held += [t for t in tensors if t is not None]
        return torch.tensor([0 if t is None else t.data_ptr() for t in tensors], dtype=torch.int64)

    def applies(self, x: torch.Tensor, meta: AttentionMetadata, kv_caches: Sequence[KVCache]) -> bool:
        if meta.is_prefill or meta.static or x.shape[0] != 1 or meta.num_seqs != 1 or x.dtype != torch.float32:
            return False
        k, v = kv_caches[0]
        return k.dtype == v.dtype == torch.float32 and k.device.type == "cpu" and k.is_contiguous()

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata,
                 kv_caches: Sequence[KVCache]) -> torch.Tensor:  # fmt: skip
        """x [1, hidden] (embedded token) -> hidden states after the last layer, [1, hidden]."""
        x = x.contiguous().clone()  # the kernel updates the residual stream in place
        cos, sin = cos.contiguous(), sin.contiguous()
        block_size = kv_caches[0][0].shape[1]
        dims = self._dims.get(block_size)
        if dims is None:
            dims = self._dims[block_size] = torch.tensor(self._dims_base + [block_size], dtype=torch.int64)
        table = meta.block_tables.contiguous()
        length, slot = meta.kv_lens[0], int(meta.slot_mapping[0])
        threads = torch.get_num_threads()
        layer = self._kernels.layer
        args = (dims.data_ptr(), self._eps, self._scale, cos.data_ptr(), sin.data_ptr())
        for ptrs, (k, v) in zip(self._tables, kv_caches, strict=True):
            rc = layer(x.data_ptr(), ptrs.data_ptr(), *args, k.data_ptr(), v.data_ptr(), table.data_ptr(), length,
                       slot, threads)  # fmt: skip
            if rc != 0:
                raise ValueError(f"fused decode layer rejected its shapes (rc={rc})")
        return x
