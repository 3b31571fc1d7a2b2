"""Small-batch decode through the compiled whole-layer kernel (cpu_kernels/csrc/decode/decode.cpp).

Why: at small batch on the CPU a decode step is a stream over the weights,
and the ~25 small torch ops per layer around the linears (norms, rotary, KV
write and gather, SDPA, SiLU, residual adds) cost about as much dispatch
time as the weights take to read. The kernel runs a layer in one call and
reads each weight row once for all the batch's rows.

It applies only where it computes what the torch path does: CPU, float32
or bfloat16 weights and pool (one dtype for all), one unsharded process (no
all-reduce between the halves of a layer), up to FUSED_MAX_BATCH sequences
with one new token each (not prefill, not speculative verification). Above
that the linears are compute-bound and oneDNN's GEMM is faster (measured,
see FUSED_MAX_BATCH). Everything else, and
`--no-cpu-kernels`, takes the module path. The layer's parameters are read
through pointers taken at pack time: a model whose parameters are replaced
afterwards must be packed again (as for packed_linear's copies); the
tensors are held here, so a stale table never points at freed memory.

bfloat16: the kernel reads bf16 weights and pool, and keeps the residual
stream, cos/sin and every intermediate in float32 across all layers (the
embedding is widened once, the result narrowed once before the final norm):
closer to a float32 model than torch's bf16 modules, which round each
intermediate, and no slower (the weights are the traffic).

int8 (`--quantize int8`, QuantizedLinear everywhere in the layers): the same
layer with int8_rows.h's linears (the module path's per-row activation
quantization, int32 sums, down_proj's Hadamard rotation) over the packed
weights QuantizedLinear holds; norms and pool in the model dtype, the rest
float32 as above. The integer sums are the module path's wherever the
quantized rows are, and those differ only where float32 intermediates round
differently from the module path's model-dtype ones. The output head
stays a module (an int8 QuantizedLinear where quantized: the same kernel).
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from pagemill.attention.metadata import AttentionMetadata
from pagemill.cpu_kernels.decode import DecodeKernels
from pagemill.cpu_kernels.matvec import BF16_MUL
from pagemill.models.quantized_linear import QuantizedLinear

KVCache = tuple[torch.Tensor, torch.Tensor]

# Largest batch that takes the kernel (at most DecodeKernels.layer_max_rows).
# Measured on the default model, 2 threads, idle machine, decode step median
# fused vs module path (benchmarks/decode_ab.py): batch 1 20.6 vs 27.8 ms,
# 2: 25.0 vs 52.0, 3: 30.4 vs 47.6, 4: 39.8 vs 52.2, 5: 38.7 vs 44.5,
# 6: 53.6 vs 51.7, 8: 51.8 vs 44.5 (oneDNN's GEMM wins from 6 rows).
FUSED_MAX_BATCH = 5
# The same for bfloat16 weights: the layer's maximum. Measured with
# benchmarks/bf16_ab.py --threads 1 (a shared, noisy machine; docs/cpu.md),
# fused vs module path (packed oneDNN bf16 + in-place attention): batch 4
# 54.5 vs 63.3 ms, 5: 54 vs 74; 6 and 8 even (68 vs 62, 78 vs 79 in one run,
# 44 vs 54, 98 vs 109 in another).
FUSED_MAX_BATCH_BF16 = 8
# bf16 where the module path's linears run our GEMM (models/packed_linear.py, gemm_bf16.h), which
# streams the weights faster than the layer's row-by-row dot products from a few rows. Measured
# (fused and module path alternating step by step in one process, default model, wall clock,
# medians of 20 steps, docs/cpu.md): 2 threads, batch 4 12.6 vs 14.4 ms, 5 18.0 vs 18.6, 6 19.9 vs
# 16.1, 8 21.9 vs 17.9; 1 thread, batch 4 18.7 vs 19.1, 5 25.1 vs 20.3, 8 36.3 vs 24.4.
FUSED_MAX_BATCH_BF16_GEMM = 4
# ... and where that GEMM runs on AMX tiles (gemm_amx.h, from 4 rows; 2-3 rows its vdpbf16ps
# tiles), whose batched decode layer takes over from 2 sequences. Measured on a 2-vCPU AMX Xeon
# (2026-12-05; fused and batched layer alternating in blocks of 4 steps in one process, default
# model, 2 threads, ~150-280 tokens of context, medians of 60 steps, two runs): batch 1 13.3 vs
# 13.9 ms, 2 17.0-17.3 vs 14.7-15.1, 3 16.6-17.8 vs 16.4-16.8, 4 19.7-20.0 vs 16.2-17.1, 8 28.2
# vs 20.3: this CPU's vdpbf16ps (~115 GFLOP/s a core) makes the layer's dot products
# compute-bound from 2 rows.
FUSED_MAX_BATCH_BF16_AMX = 1
# int8 weights: the layer's maximum. The module path runs the same int8 kernel per linear plus
# ~25 torch ops per layer; measured (benchmarks/int8_speed.py --fused-ab, 1 thread, rest bf16,
# shared machine; docs/quantization.md) fused vs module path: batch 1 20.9 vs 35.3 ms, 4: 33.1
# vs 47.7, 8: 64.5 vs 87.4. From 8 rows its linears run on AMX-INT8 tiles (int8_amx.h), the
# module path's too, and the layer keeps its lead at larger batches (2 threads, AMX Xeon,
# 2026-12-06): 16: 11.2 vs 20.0 ms, 32: 16.3 vs 22.9, 64: 28.1 vs 35.5; so it takes every decode
# step up to its maximum (docs/quantization.md).
FUSED_MAX_BATCH_INT8 = 256
# Batches up to which the shard's thread chooser (shard/threads.py) may run a fused step on
# one thread: the small ones, where two threads' barriers can cost more than they gain.
FUSED_MAX_SMALL_BATCH = 8
_DTYPES = (torch.float32, torch.bfloat16)


class LayerDims:
    """A decode layer kernel's dims table (the model's shape, then the pool's block size), one
    tensor per block size, made once."""

    def __init__(self, base: list[int]) -> None:
        self._base = base
        self._by_block: dict[int, torch.Tensor] = {}

    def __call__(self, block_size: int) -> torch.Tensor:
        dims = self._by_block.get(block_size)
        if dims is None:
            dims = self._by_block[block_size] = torch.tensor(self._base + [block_size], dtype=torch.int64)
        return dims


def pool_pointers(kv_caches: Sequence[KVCache], layers: int, who: str) -> torch.Tensor:
    """The layers' pools as the whole-model calls take them: [k0, v0, k1, v1, ...] addresses
    (cpu_kernels/csrc/common/each_layer.h); one (k, v) pair per layer or ValueError, before anything runs."""
    if len(kv_caches) != layers:
        raise ValueError(f"{who}: {len(kv_caches)} KV caches for {layers} layers")
    return torch.tensor([t.data_ptr() for pair in kv_caches for t in pair], dtype=torch.int64)


def step_tables(meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(block tables int32, context lens int32, slot mapping int64), contiguous, as the compiled
    decode layers read a step's metadata."""
    return (meta.block_tables.to(torch.int32).contiguous(), meta.context_lens.to(torch.int32).contiguous(),
            meta.slot_mapping.to(torch.int64).contiguous())  # fmt: skip


class LayerTables:
    """What a whole-model call reads of every layer, set up once at pack time: the attention
    scale, the layer dims, each layer's pointer table (the subclass's _pointer_table, which may
    keep what it points at in _held) and their addresses, and the sliding windows."""

    def _index_layers(self, layers: nn.ModuleList) -> None:
        first = layers[0]
        attn, mlp = first.self_attn, first.mlp
        self._scale = attn.scale
        self._dims = LayerDims([first.input_layernorm.weight.shape[0], attn.num_heads, attn.num_kv_heads,
                                attn.head_dim, mlp.intermediate_size])  # fmt: skip
        self._held: list[torch.Tensor] = []
        self._tables = [self._pointer_table(layer) for layer in layers]
        self._table_addrs = torch.tensor([t.data_ptr() for t in self._tables], dtype=torch.int64)
        # Each layer's sliding window (0: global), as the kernels take it.
        self._windows = torch.tensor([layer.self_attn.sliding_window or 0 for layer in layers], dtype=torch.int64)


class FusedDecoder(LayerTables):
    def __init__(self, layers: nn.ModuleList, kernels: DecodeKernels, eps: float, dtype: torch.dtype,
                 int8: bool = False) -> None:  # fmt: skip
        """dtype: the norms' and the pool's; int8: the linears are QuantizedLinears."""
        self._kernels = kernels
        self._eps = eps
        self.dtype = dtype
        self.int8 = int8
        # (qkv's: gate_up's GEMM copy may have moved to the MLP's SwiGLU packing, layers.MLP.pack_swiglu)
        gemm = getattr(getattr(layers[0].self_attn, "qkv_proj", None), "gemm", None) if dtype == torch.bfloat16 else None
        if int8:
            bound = FUSED_MAX_BATCH_INT8
        elif dtype == torch.float32:
            bound = FUSED_MAX_BATCH
        elif gemm is None:
            bound = FUSED_MAX_BATCH_BF16
        else:
            bound = FUSED_MAX_BATCH_BF16_AMX if gemm.amx else FUSED_MAX_BATCH_BF16_GEMM
        self.max_batch = min(bound, kernels.layer_int8_max_rows if int8 else kernels.layer_max_rows)
        # bf16 only: how the linears multiply (cpu_kernels.BF16_MUL; benchmarks switch it).
        self.mul = "auto"
        self._index_layers(layers)

    @classmethod
    def build(cls, model: nn.Module, kernels: DecodeKernels | None) -> "FusedDecoder | None":
        """The decoder for `model` (a LlamaForCausalLM), or None where the kernel does not apply."""
        if kernels is None or model.group.world_size != 1:
            return None
        layers = model.model.layers
        int8 = all(isinstance(m, QuantizedLinear) and m.kernel is not None for layer in layers
                   for m in cls._linears(layer))  # fmt: skip
        # An int8 model's float parameters (the norms) set the dtype; its weights are int8.
        params = [p for layer in layers for p in layer.parameters() if not (int8 and p.dtype == torch.int8)]
        if not params or params[0].dtype not in _DTYPES:
            return None
        dtype = params[0].dtype
        if any(p.device.type != "cpu" or p.dtype != dtype or not p.is_contiguous() for p in params):
            return None
        if model.config.head_dim % 2 or len({layer.input_layernorm.eps for layer in layers}) != 1:
            return None
        # A layer with a weight the kernel never reads (Qwen3's q/k norms, an o_proj bias) computes
        # something else than the kernel would: it keeps the module path.
        tensors = cls._int8_tensors if int8 else cls._layer_tensors
        known = {id(t) for layer in layers for t in tensors(layer) if isinstance(t, torch.Tensor)}
        if any(id(p) not in known for layer in layers for p in layer.parameters()):
            return None
        return cls(layers, kernels, layers[0].input_layernorm.eps, dtype, int8)

    @staticmethod
    def _linears(layer: nn.Module) -> list[nn.Module | None]:
        attn, mlp = layer.self_attn, layer.mlp
        return [getattr(attn, "qkv_proj", None), getattr(attn, "o_proj", None), getattr(mlp, "gate_up_proj", None),
                getattr(mlp, "down_proj", None)]  # fmt: skip

    @staticmethod
    def _layer_tensors(layer: nn.Module) -> list[torch.Tensor | None]:
        """What the kernel reads of one layer, in its pointer table's order."""
        attn, mlp = layer.self_attn, layer.mlp
        return [layer.input_layernorm.weight, attn.qkv_proj.weight, attn.qkv_proj.bias, attn.o_proj.weight,
                layer.post_attention_layernorm.weight, mlp.gate_up_proj.weight, mlp.gate_up_proj.bias,
                mlp.down_proj.weight, mlp.down_proj.bias]  # fmt: skip

    @classmethod
    def _int8_tensors(cls, layer: nn.Module) -> list[torch.Tensor | int | None]:
        """decode.cpp's Int8Linears table: the two norms, then per linear (qkv, o, gate_up, down)
        packed weight, w_scale, w_corr, bias, rotate."""
        out: list[torch.Tensor | int | None] = [layer.input_layernorm.weight, layer.post_attention_layernorm.weight]
        for m in cls._linears(layer):
            out += [m.qweight, m.w_scale, m.w_corr, m.bias, m.rotate]
        return out

    def _pointer_table(self, layer: nn.Module) -> torch.Tensor:
        if self.int8:
            entries, size = self._int8_tensors(layer), self._kernels.layer_int8_ptrs
        else:
            entries, size = self._layer_tensors(layer), self._kernels.layer_ptrs
        assert len(entries) == size
        self._held += [t for t in entries if isinstance(t, torch.Tensor)]
        return torch.tensor([t.data_ptr() if isinstance(t, torch.Tensor) else t or 0 for t in entries],
                            dtype=torch.int64)  # fmt: skip

    @property
    def max_small_batch(self) -> int:
        """The batches the shard's thread chooser may run on one thread (FUSED_MAX_SMALL_BATCH)."""
        return min(self.max_batch, FUSED_MAX_SMALL_BATCH)

    def applies(self, x: torch.Tensor, meta: AttentionMetadata, kv_caches: Sequence[KVCache]) -> bool:
        n = x.shape[0]
        if meta.is_prefill or meta.static or n != meta.num_seqs or x.dtype != self.dtype:
            return False
        if not 1 <= n <= self.max_batch:
            return False
        k, v = kv_caches[0]
        return k.dtype == v.dtype == self.dtype and k.device.type == "cpu" and k.is_contiguous()

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata,
                 kv_caches: Sequence[KVCache]) -> torch.Tensor:  # fmt: skip
        """x [B, hidden] (each sequence's embedded token) -> hidden states after the last layer, in
        x's dtype. cos/sin [B, head_dim] float32."""
        # The kernel updates the residual stream in place, in float32.
        x = x.to(torch.float32, copy=True).contiguous()
        cos, sin = cos.float().contiguous(), sin.float().contiguous()
        dims = self._dims(kv_caches[0][0].shape[1])
        tables, lens, slots = step_tables(meta)
        kv = pool_pointers(kv_caches, len(self._tables), "fused decode")
        failed = torch.zeros(1, dtype=torch.int64)
        args = (x.data_ptr(), x.shape[0], len(self._tables), self._table_addrs.data_ptr(), dims.data_ptr(), self._eps,
                self._scale, cos.data_ptr(), sin.data_ptr(), kv.data_ptr(), tables.data_ptr(), tables.shape[1],
                lens.data_ptr(), slots.data_ptr(), self._windows.data_ptr(), torch.get_num_threads())  # fmt: skip
        if self.int8:
            rc = self._kernels.layers_int8(*args, int(self.dtype == torch.bfloat16), failed.data_ptr())
        elif self.dtype == torch.bfloat16:
            rc = self._kernels.layers_bf16(*args, BF16_MUL[self.mul], failed.data_ptr())
        else:
            rc = self._kernels.layers(*args, failed.data_ptr())
        if rc != 0:
            raise ValueError(f"fused decode layer {int(failed)} rejected its shapes (rc={rc})")
        return x.to(self.dtype)


# GGUF linears (models/gguf/linear.py on QuantKernel). Measured on Gemma 3 270M Q4_K_M, 1 thread,
# 2-vCPU Zen 3 shared with other jobs (load 4-6), fused vs module path, decode step medians
# alternating in one process: batch 1 35.2 vs 65.8 ms, 4: 59.0 vs 79.9, 8: 78.8-92.4 vs
# 103.8-110.2, 16: 149.9 vs 195.8, 32: 351.9 vs 423.0 (782 vs 880 under heavier load); 64: 817.6
# vs 747.2 with the activation still on scalar tanhf (since vectorised; not measured again).
FUSED_MAX_BATCH_GGUF = 32
# decode_gguf.cpp's flags.
_GEMMA_NORMS, _GELU, _LOCAL_ROPE = 1, 2, 4


class GGUFFusedDecoder(LayerTables):
    """Every decoder layer of a model whose linears are GGUF blocks on the compiled QuantKernel,
    in one call per decode step (cpu_kernels/csrc/decode/decode_gguf.cpp): the Llama layer
    (with or without q/k norms, SiLU) and Gemma's (four norms scaling by 1 + w, q/k norms, GELU,
    windowed layers on their own rotary). Each linear's parts (GGUFConcatLinear: q|k|v or
    gate|up of different types) are read from the prepared blocks through pointers taken here;
    the integer sums are QuantKernel.linear's, everything between them float32.

    Applies where the module path computes what the layer does: one unsharded CPU process, every
    linear of every layer a GGUFLinear (or GGUFConcatLinear of up to 3) of a quantized type on the
    kernel, the norms and pool float32 or bfloat16 (one dtype), no attention-logit cap, no
    parameter the layer would not read, 1 to FUSED_MAX_BATCH_GGUF sequences of one token each."""

    def __init__(self, layers: nn.ModuleList, kernels: DecodeKernels, dtype: torch.dtype, flags: int) -> None:
        self._kernels = kernels
        self.dtype = dtype
        self.flags = flags
        self.int8 = False
        self.max_batch = min(FUSED_MAX_BATCH_GGUF, kernels.layer_gguf_max_rows)
        self._eps = layers[0].input_layernorm.eps
        self._index_layers(layers)

    @staticmethod
    def _parts(m: nn.Module | None) -> list | None:
        """The GGUFLinears of one projection, in output order; None where it is anything else."""
        from pagemill.models.gguf.linear import GGUFConcatLinear, GGUFLinear

        parts = list(m.parts) if isinstance(m, GGUFConcatLinear) else [m] if isinstance(m, GGUFLinear) else None
        if not parts or len(parts) > 3:
            return None
        from pagemill.cpu_kernels.quant import FLOAT_TYPES

        if any(not isinstance(p, GGUFLinear) or not p.on_kernel or p.qtype in FLOAT_TYPES for p in parts):
            return None
        return parts

    @staticmethod
    def _norms(layer: nn.Module, gemma: bool) -> list[nn.Module | None]:
        """decode_gguf.cpp's six norms: input, post-attention, pre-MLP, post-MLP, q, k."""
        attn = layer.self_attn
        q, k = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
        if gemma:
            return [layer.input_layernorm, layer.post_attention_layernorm, layer.pre_feedforward_layernorm,
                    layer.post_feedforward_layernorm, q, k]  # fmt: skip
        return [layer.input_layernorm, None, layer.post_attention_layernorm, None, q, k]

    @classmethod
    def build(cls, model: nn.Module, kernels: DecodeKernels | None) -> "GGUFFusedDecoder | None":
        """The decoder for `model` (a LlamaForCausalLM or GemmaForCausalLM holding GGUF linears),
        or None where the layer does not apply."""
        from pagemill.models.gemma import GegluMLP, GemmaRMSNorm
        from pagemill.models.layers import MLP, RMSNorm

        if kernels is None or model.group.world_size != 1 or not hasattr(kernels, "layers_gguf"):
            return None
        layers = model.model.layers
        gemma = hasattr(layers[0], "pre_feedforward_layernorm")
        norm_cls = GemmaRMSNorm if gemma else RMSNorm
        mlp_cls = GegluMLP if gemma else MLP
        known: set[int] = set()
        for layer in layers:
            attn, mlp = layer.self_attn, layer.mlp
            if type(mlp) is not mlp_cls or getattr(attn, "softcap", None) is not None or attn.head_dim % 2:
                return None
            norms = cls._norms(layer, gemma)
            if (norms[4] is None) != (norms[5] is None):
                return None
            if any(n is not None and type(n) is not norm_cls for n in norms):
                return None
            if len({n.eps for n in norms if n is not None}) != 1:
                return None
            for proj in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj):
                parts = cls._parts(proj)
                if parts is None:
                    return None
                known |= {id(p.bias) for p in parts if p.bias is not None}
            known |= {id(n.weight) for n in norms if n is not None}
        params = [p for layer in layers for p in layer.parameters()]
        if not params or any(id(p) not in known for p in params):
            return None  # a weight the layer would not read: it computes something else
        dtype = layers[0].input_layernorm.weight.dtype
        norm_weights = [n.weight for layer in layers for n in cls._norms(layer, gemma) if n is not None]
        if dtype not in _DTYPES or any(w.dtype != dtype or w.device.type != "cpu" or not w.is_contiguous()
                                       for w in norm_weights):  # fmt: skip
            return None
        if len({layer.input_layernorm.eps for layer in layers}) != 1:
            return None
        flags = (_GEMMA_NORMS | _GELU | (_LOCAL_ROPE if hasattr(model.model, "local_rotary") else 0)) if gemma else 0
        return cls(layers, kernels, dtype, flags)

    def _pointer_table(self, layer: nn.Module) -> torch.Tensor:
        attn, mlp = layer.self_attn, layer.mlp
        entries: list[int] = []
        for n in self._norms(layer, bool(self.flags & _GEMMA_NORMS)):
            if n is not None:
                self._held.append(n.weight)
            entries.append(0 if n is None else n.weight.data_ptr())
        for proj in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj):
            parts = self._parts(proj)
            assert parts is not None
            for p in parts:
                tail = p.kernel.tail(p.prepared)
                held = [t for t in (p.prepared.data, tail, p.kernel_bias) if t is not None]
                self._held += held
                entries += [p.qtype, p.prepared.data_ptr, p.out_features, 0 if tail is None else tail.data_ptr(),
                            0 if p.kernel_bias is None else p.kernel_bias.data_ptr()]  # fmt: skip
            entries += [0] * 5 * (3 - len(parts))
        assert len(entries) == self._kernels.layer_gguf_ptrs
        return torch.tensor(entries, dtype=torch.int64)

    @property
    def max_small_batch(self) -> int:
        return min(self.max_batch, FUSED_MAX_SMALL_BATCH)

    def applies(self, x: torch.Tensor, meta: AttentionMetadata, kv_caches: Sequence[KVCache]) -> bool:
        n = x.shape[0]
        if meta.is_prefill or meta.static or n != meta.num_seqs or not 1 <= n <= self.max_batch:
            return False
        k, v = kv_caches[0]
        return k.dtype == v.dtype == self.dtype and k.device.type == "cpu" and k.is_contiguous()

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata,
                 kv_caches: Sequence[KVCache], cos_local: torch.Tensor | None = None,
                 sin_local: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
        """x [B, hidden] (each sequence's embedded token) -> hidden states after the last layer, in
        the norms' dtype. cos/sin [B, head_dim]; cos_local/sin_local: the windowed layers' (Gemma)."""
        x = x.to(torch.float32, copy=True).contiguous()
        cos, sin = cos.float().contiguous(), sin.float().contiguous()
        if self.flags & _LOCAL_ROPE:
            if cos_local is None or sin_local is None:
                raise ValueError("fused GGUF decode: this model's windowed layers need their cos/sin")
            cos_local, sin_local = cos_local.float().contiguous(), sin_local.float().contiguous()
        else:
            cos_local, sin_local = cos, sin
        dims = self._dims(kv_caches[0][0].shape[1])
        tables, lens, slots = step_tables(meta)
        kv = pool_pointers(kv_caches, len(self._tables), "fused GGUF decode")
        failed = torch.zeros(1, dtype=torch.int64)
        rc = self._kernels.layers_gguf(x.data_ptr(), x.shape[0], len(self._tables), self._table_addrs.data_ptr(),
                                       dims.data_ptr(), self._eps, self._scale, self.flags, cos.data_ptr(),
                                       sin.data_ptr(), cos_local.data_ptr(), sin_local.data_ptr(), kv.data_ptr(),
                                       tables.data_ptr(), tables.shape[1], lens.data_ptr(), slots.data_ptr(),
                                       self._windows.data_ptr(), int(kv_caches[0][0].dtype == torch.bfloat16),
                                       torch.get_num_threads(), failed.data_ptr())  # fmt: skip
        if rc != 0:
            raise ValueError(f"fused GGUF decode layer {int(failed)} rejected its shapes (rc={rc})")
        return x.to(self.dtype)
