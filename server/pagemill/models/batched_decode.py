"""Batched bf16 steps through one compiled call for all layers (cpu_kernels/csrc/decode/decode_batched.cpp).

Why: from ~5 sequences a bf16 decode step takes the module path, whose
linears run gemm_bf16's tiles at close to the cores' multiply rate, but each
layer also makes ~10 small calls around them (norms, rotary, KV write,
attention, SiLU, the Python between): at 64 sequences on the default model
that was ~11 ms of a ~67 ms step (docs/cpu.md). The kernel runs the same
layer, with the same functions and roundings, in one call: its results are
the module path's bit for bit (tests/test_batched_decode.py). Steps with
prompt chunks (prefill, and mixed steps: a chunk beside decode rows, most
steps under a steady stream of arrivals) take the same layer with the
chunks' attention (prefill_attention.h; a mixed step's leading decode rows
attend as a decode step's): 64 decode rows beside a 16-token chunk went from
54 to 45 ms (docs/cpu.md).

It applies where the module path would run exactly those functions: CPU,
bfloat16 weights and pool, one unsharded process, every linear on
gemm_bf16's packed weight (packed_linear.bf16_linear_path chose "kernel";
gate_up with the SwiGLU epilogue, layers.MLP.pack_swiglu),
the plain Llama layer (no q/k norms, no o_proj bias, SwiGLU, no soft cap),
decode steps of one new token per sequence above the fused layer's batch
(models/fused_decode.py) and steps with prompt chunks, attention through the
compiled kernels (the CPU backend's default). Everything else keeps the
module path. As with fused_decode, the parameters are read through pointers
taken at pack time.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from pagemill.attention.metadata import AttentionMetadata
from pagemill.cpu_kernels.decode import DecodeKernels
from pagemill.models.fused_decode import LayerTables, pool_pointers, step_tables
from pagemill.models.layers import MLP, RMSNorm

KVCache = tuple[torch.Tensor, torch.Tensor]


class BatchedDecoder(LayerTables):
    def __init__(self, layers: nn.ModuleList, kernels: DecodeKernels, eps: float) -> None:
        self._kernels = kernels
        self._eps = eps
        self._index_layers(layers)  # the tables keep what they point at alive in _held
        self._attn = layers[0].self_attn  # whose backend must be the compiled kernels' (see applies)

    @classmethod
    def build(cls, model: nn.Module, kernels: DecodeKernels | None) -> "BatchedDecoder | None":
        """The decoder for `model` (a LlamaForCausalLM), or None where it does not apply."""
        from pagemill.models.llama import Attention, DecoderLayer

        if kernels is None or model.group.world_size != 1:
            return None
        layers = model.model.layers
        for layer in layers:
            attn = layer.self_attn
            if type(layer) is not DecoderLayer or type(layer.mlp) is not MLP \
                    or type(layer.input_layernorm) is not RMSNorm or type(layer.post_attention_layernorm) is not RMSNorm \
                    or type(attn).before_rotary is not Attention.before_rotary or attn.softcap is not None:
                return None  # fmt: skip
            for m in cls._linears(layer):
                if getattr(m, "gemm", None) is None or m.packed is None or m.packed.shape[1] * 2 != m.in_features:
                    return None  # not on gemm_bf16's packing, or an odd K (padded)
            if layer.mlp.swiglu is None:
                return None  # gate_up not packed for the SwiGLU epilogue (MLP.pack_swiglu)
            tensors = [t for t in cls._layer_tensors(layer) if t is not None]
            if any(t.dtype != torch.bfloat16 or t.device.type != "cpu" or not t.is_contiguous() for t in tensors):
                return None
            # A weight the kernel never reads (an o_proj bias, q/k norms) computes something else.
            if {id(p) for p in layer.parameters()} - {id(t) for t in tensors}:
                return None
        if model.config.head_dim % 2 or len({layer.input_layernorm.eps for layer in layers} |
                                            {layer.post_attention_layernorm.eps for layer in layers}) != 1:
            return None  # fmt: skip
        return cls(layers, kernels, layers[0].input_layernorm.eps)

    @staticmethod
    def _linears(layer: nn.Module) -> list[nn.Module]:
        """The linears on our GEMM's packing (gate_up's is the MLP's SwiGLU one)."""
        return [layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.down_proj]

    @staticmethod
    def _layer_tensors(layer: nn.Module) -> list[torch.Tensor | None]:
        """The parameters the kernel reads, in its table's order (the packed weights stand for
        their plain ones, which the parameter check needs too)."""
        attn, mlp = layer.self_attn, layer.mlp
        return [layer.input_layernorm.weight, attn.qkv_proj.weight, attn.qkv_proj.bias, attn.o_proj.weight,
                layer.post_attention_layernorm.weight, mlp.gate_up_proj.weight, mlp.gate_up_proj.bias,
                mlp.down_proj.weight, mlp.down_proj.bias]  # fmt: skip

    def _pointer_table(self, layer: nn.Module) -> torch.Tensor:
        attn, mlp = layer.self_attn, layer.mlp
        _, swiglu_w, swiglu_b = mlp.swiglu
        entries = [layer.input_layernorm.weight, attn.qkv_proj.packed, attn.qkv_proj.bias, attn.o_proj.packed,
                   layer.post_attention_layernorm.weight, swiglu_w, swiglu_b, mlp.down_proj.packed,
                   mlp.down_proj.bias]  # fmt: skip
        assert len(entries) == self._kernels.batched_ptrs
        self._held += [t for t in entries if t is not None]
        return torch.tensor([0 if t is None else t.data_ptr() for t in entries], dtype=torch.int64)

    def applies(self, x: torch.Tensor, meta: AttentionMetadata, kv_caches: Sequence[KVCache]) -> bool:
        n = x.shape[0]
        if meta.static or n < 1 or x.dtype != torch.bfloat16 or (not meta.is_prefill and n != meta.num_seqs):
            return False
        if getattr(self._attn.backend, "kernels", None) is None:
            return False  # the module path's attention is torch's (a reference backend): not ours to replace
        k, v = kv_caches[0]
        return k.dtype == v.dtype == torch.bfloat16 and k.device.type == "cpu" and k.is_contiguous() \
            and v.is_contiguous()  # fmt: skip

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata,
                 kv_caches: Sequence[KVCache]) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """x [B, hidden] bf16 (the step's embedded tokens: one per sequence in a decode step, the
        chunks' rows in a step with prompt chunks), cos/sin [B, head_dim] bf16 -> (the last
        layer's MLP output, the residual stream it adds to), as the module path's layers leave
        them."""
        x = x.clone(memory_format=torch.contiguous_format)  # updated in place, layer by layer (one copy)
        residual = torch.empty_like(x)
        cos, sin = cos.contiguous(), sin.contiguous()
        k0 = kv_caches[0][0]
        dims = self._dims(k0.shape[1])
        tables, lens, slots = step_tables(meta)
        num_slots = k0.shape[0] * k0.shape[1]
        b, threads = x.shape[0], torch.get_num_threads()
        kv = pool_pointers(kv_caches, len(self._tables), "batched decode")
        if meta.is_prefill:  # rows of prompt chunks: their sequences' row ranges come along
            cu = meta.cu_seqlens_q.to(torch.int32).contiguous()
            cu_ptr, seqs = cu.data_ptr(), meta.num_seqs
        else:
            cu_ptr, seqs = None, b
        failed = torch.zeros(1, dtype=torch.int64)
        rc = self._kernels.batched_layers_bf16(
            x.data_ptr(), residual.data_ptr(), b, len(self._tables), self._table_addrs.data_ptr(), dims.data_ptr(),
            self._eps, self._scale, cos.data_ptr(), sin.data_ptr(), kv.data_ptr(), tables.data_ptr(),
            tables.shape[1], lens.data_ptr(), cu_ptr, seqs, slots.data_ptr(), num_slots, self._windows.data_ptr(),
            threads, failed.data_ptr())  # fmt: skip
        if rc >= 2:
            raise IndexError(f"batched decode: slot {int(slots[rc - 2])} is outside the pool's {num_slots}")
        if rc != 0:
            raise ValueError(f"batched decode layer {int(failed)} rejected its shapes (rc={rc})")
        return x, residual
