"""Adapters fitted to the model's own linears: fused projections, tensor-parallel slices.

Our q/k/v and gate/up projections are one linear each (models/llama.py STACKED_PARAMS) and,
under tensor parallelism, every rank holds a slice (parallel/partition.py). Rather than a
second copy of that bookkeeping, an adapter's A and B are placed by the loader's own map,
LlamaForCausalLM.checkpoint_targets: a projection whose checkpoint rows fill rows `dest` of a
column-parallel linear has its B rows sliced the same way (A whole), and a row-parallel one
(o_proj, down_proj) whose checkpoint columns are sliced has A's columns sliced the same way (B
whole), its partial product adding into the partial base output before the all-reduce. So any
architecture whose checkpoint loads through that map (Llama, Mistral, Qwen2/3, Phi-3's fused
names, Gemma 2/3, the dense layers and attention of the MoE models) takes adapters alike.
"""

from __future__ import annotations

import torch
from torch import nn

from pagemill.lora.adapter import AdapterError, PeftAdapter
from pagemill.lora.apply import LoadedAdapter, LoraContext, LoraLayer, ModuleWeights

# Our adaptable linears inside one decoder layer, and how many HF projections each fuses.
SLOTS = {"self_attn.qkv_proj": 3, "self_attn.o_proj": 1, "mlp.gate_up_proj": 2, "mlp.down_proj": 1}


def install(model: nn.Module) -> LoraContext:
    """Gives every adaptable linear of `model` its LoraLayer (idempotent); returns the context
    they share. PackedLinears call it themselves (before a row-parallel all-reduce); other
    linears (int8, GGUF blocks) through a forward hook."""
    from pagemill.models.packed_linear import PackedLinear

    existing = getattr(model, "lora_context", None)
    if existing is not None:
        return existing
    ctx = LoraContext()
    invariant = next((m.invariant for m in model.modules() if getattr(m, "invariant", None) is not None), None)
    for i, layer in enumerate(model.model.layers):
        for path, parts in SLOTS.items():
            try:
                lin = layer.get_submodule(path)
            except AttributeError:
                continue  # an MoE layer's mlp has no dense gate_up_proj
            if not hasattr(lin, "in_features") or not hasattr(lin, "out_features"):
                continue
            lora = LoraLayer(f"model.layers.{i}.{path}", lin.in_features, lin.out_features, parts, ctx, invariant)
            if isinstance(lin, PackedLinear):
                lin.lora = lora
            else:
                lin.register_forward_hook(lora.hook)
                lin.lora = lora
    model.lora_context = ctx
    model.model.lora_context = ctx  # LlamaModel: steps with adapter rows skip the fused layers
    return ctx


def lora_layers(model: nn.Module) -> dict[str, LoraLayer]:
    return {m.lora.name: m.lora for m in model.modules() if isinstance(getattr(m, "lora", None), LoraLayer)}


def full_shape(config, leaf: str) -> tuple[int, int]:
    """(in, out) of HF projection `leaf` in the whole (unsharded) model."""
    h, d, i = config.hidden_size, config.head_dim, config.intermediate_size
    q, kv = config.num_attention_heads * d, config.num_key_value_heads * d
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h), "gate_proj": (h, i),
            "up_proj": (h, i), "down_proj": (i, h), "qkv_proj": (h, q + 2 * kv), "gate_up_proj": (h, 2 * i)}[leaf]


def fit_adapter(model: nn.Module, peft: PeftAdapter, adapter_id: int, name: str, dtype: torch.dtype,
                device: torch.device) -> LoadedAdapter:  # fmt: skip
    """The adapter on this rank's linears, in the model's dtype and device; AdapterError when
    it targets something the model lacks or its shapes do not match the base."""
    layers = lora_layers(model)
    pieces: dict[str, list[tuple[int, torch.Tensor, torch.Tensor]]] = {}  # ours -> (first out row, A, B)
    for hf, (a, b) in peft.weights.items():
        targets = model.checkpoint_targets(f"{hf}.weight")
        for t in targets:
            if t.param.rpartition(".")[0] not in layers:
                raise AdapterError(f"adapter {peft.path}: {hf} has no adaptable linear in this model "
                                   f"(adapters apply to {', '.join(SLOTS)} of dense decoder layers)")  # fmt: skip
        leaf = hf.rpartition(".")[2]
        want_in, want_out = full_shape(model.config, leaf)
        if a.shape[1] != want_in or b.shape[0] != want_out:
            raise AdapterError(f"adapter {peft.path}: {hf} has lora_A {list(a.shape)} and lora_B {list(b.shape)}; "
                               f"the base model's {leaf} maps {want_in} -> {want_out} features")  # fmt: skip
        for t in targets:
            ours = t.param.rpartition(".")[0]
            layer = layers[ours]
            if t.src_dim == 0:  # column-parallel: this rank's output rows of B, A whole
                rows = b if t.src is None else b[t.src.start : t.src.end]
                dest = (0, layer.out_features) if t.dest is None else (t.dest.start, t.dest.size)
                pieces.setdefault(ours, []).append((dest[0], a, rows))
                if rows.shape[0] != dest[1] or a.shape[1] != layer.in_features:
                    raise AdapterError(f"adapter {peft.path}: {hf} does not fit {ours}")
            else:  # row-parallel: this rank's input columns of A, B whole
                cols = a if t.src is None else a[:, t.src.start : t.src.end]
                pieces.setdefault(ours, []).append((0, cols, b))
                if cols.shape[1] != layer.in_features or b.shape[0] != layer.out_features:
                    raise AdapterError(f"adapter {peft.path}: {hf} does not fit {ours}")
    modules, nbytes = {}, 0
    for ours, parts in pieces.items():
        layer = layers[ours]
        a = torch.cat([p[1] for p in parts])  # [R, in]
        b = torch.zeros(layer.out_features, a.shape[0])
        col = 0
        for first, pa, pb in parts:  # block-diagonal: part j's rank columns feed only its rows
            b[first : first + pb.shape[0], col : col + pa.shape[0]] = pb * peft.scaling
            col += pa.shape[0]
        w = ModuleWeights(a.to(device=device, dtype=dtype).contiguous(), b.to(device=device, dtype=dtype).contiguous())
        modules[ours] = w
        nbytes += w.a.numel() * w.a.element_size() + w.b.numel() * w.b.element_size()
    return LoadedAdapter(adapter_id, name, peft.path, peft.rank, modules, nbytes)


def reserved_bytes(model: nn.Module, max_loras: int, max_rank: int, dtype: torch.dtype) -> int:
    """Memory max_loras adapters of rank max_rank on every adaptable linear take at most:
    fit_adapter's layout, and once more for the padded products' stacked copy of the adapters
    a step uses (apply.LoraLayer._padded)."""
    layers = lora_layers(model).values()
    per = sum(layer.parts * max_rank * (layer.in_features + layer.out_features) for layer in layers)
    return 2 * max_loras * per * torch.empty(0, dtype=dtype).element_size()
