"""Llama-family decoder (Llama, Mistral, Qwen2, SmolLM2) over packed tokens.

Qwen3 (qwen3.py) and Phi-3 (phi3.py) subclass it: they differ in one hook
(q/k norm) or in the checkpoint's layout only.

The module tree and parameter names mirror Hugging Face's LlamaForCausalLM,
except that q/k/v and gate/up projections are fused into one parameter each
(STACKED_PARAMS); the loader copies the checkpoint's tensors into their rows.
Unlike HF there is no
batch dimension: all sequences of a step are packed into one [T] axis and
attention finds each sequence's history in the paged KV pool.

Under tensor parallelism (a ParallelGroup of world_size > 1) every rank builds
the same module tree with its share of heads, intermediate features and
vocabulary rows (parallel/partition.py) and loads only those slices
(checkpoint_target); hidden states between layers are replicated, identical
on all ranks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from torch import nn

from pagemill.attention.backend import AttentionBackend
from pagemill.attention.metadata import AttentionMetadata
from pagemill.models.batched_decode import BatchedDecoder
from pagemill.models.config import ModelConfig
from pagemill.models.fused_decode import FusedDecoder, GGUFFusedDecoder
from pagemill.models.layers import MLP, RMSNorm, RotaryEmbedding, apply_rotary
from pagemill.models.packed_linear import pack_all
from pagemill.parallel.embedding import ParallelLMHead, VocabParallelEmbedding
from pagemill.parallel.group import ParallelGroup
from pagemill.parallel.linear import ColumnParallelLinear, RowParallelLinear
from pagemill.parallel.partition import Range, TPLayout

KVCache = tuple[torch.Tensor, torch.Tensor]  # (k_cache, v_cache) of one layer


@dataclass(frozen=True)
class WeightTarget:
    """Checkpoint tensor -> our parameter: rows `dest` of `param` (None: all of it) are
    filled from the `src` slice along `src_dim` of the checkpoint tensor (None: all of it)."""

    param: str
    dest: Range | None
    src_dim: int
    src: Range | None

# Checkpoint projections stored as row ranges of one fused parameter:
# HF module name -> (our module name, index of its part in the fused rows).
STACKED_PARAMS = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
}


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, backend: AttentionBackend, layout: TPLayout, group: ParallelGroup) -> None:
        super().__init__()
        # This rank's heads (all of them unless tensor-parallel; see parallel/partition.py).
        self.num_heads = layout.heads.q.size
        self.num_kv_heads = layout.heads.kv.size
        self.head_dim = config.head_dim
        self.scale = self.head_dim**-0.5
        # This layer's sliding window (None: global); the model sets it from config.layer_windows.
        self.sliding_window: int | None = None
        self.softcap: float | None = None  # attention-logit cap (Gemma 2)
        self.kernels = None  # cpu_kernels.rowwise.ElementwiseKernels (bf16 rotary on the CPU), set by pack_weights
        self.backend = backend
        h, bias = config.hidden_size, config.attention_bias
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        # q, k and v in one matmul (one pass over x, one call); the loader
        # fills the checkpoint's q_proj/k_proj/v_proj rows (STACKED_PARAMS).
        # Column-parallel: only this rank's heads; o_proj is row-parallel.
        self.qkv_sizes = [q_size, kv_size, kv_size]
        self.qkv_proj = ColumnParallelLinear(h, q_size + 2 * kv_size, bias=bias)
        self.o_proj = RowParallelLinear(q_size, h, config.o_proj_bias, group)

    def forward(self, x, cos, sin, meta: AttentionMetadata, kv_cache: KVCache) -> torch.Tensor:
        t = x.shape[0]
        qkv = self.qkv_proj(x).view(t, self.num_heads + 2 * self.num_kv_heads, self.head_dim)
        # q and k heads are adjacent in the fused output: one rotary for both.
        qk = apply_rotary(self.before_rotary(qkv[:, : self.num_heads + self.num_kv_heads]), cos, sin, self.kernels)
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        v = qkv[:, self.num_heads + self.num_kv_heads :]
        k_cache, v_cache = kv_cache
        self.backend.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        if meta.is_prefill:
            out = self.backend.prefill(q, k, v, k_cache, v_cache, meta, self.scale, self.sliding_window, self.softcap)
        else:
            out = self.backend.decode(q, k_cache, v_cache, meta, self.scale, self.sliding_window, self.softcap)
        return self.o_proj(out.reshape(t, self.num_heads * self.head_dim))

    def before_rotary(self, qk: torch.Tensor) -> torch.Tensor:
        """[T, q heads + kv heads, head_dim] as projected -> what rotary rotates (Llama: itself)."""
        return qk


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, backend: AttentionBackend, layout: TPLayout, group: ParallelGroup,
                 attention_cls: type[Attention] = Attention, mlp: nn.Module | None = None) -> None:  # fmt: skip
        """mlp: the feed-forward block (default: the dense SwiGLU MLP; models/moe.py passes experts)."""
        super().__init__()
        self.self_attn = attention_cls(config, backend, layout, group)
        self.mlp = mlp if mlp is not None else MLP(config, layout.intermediate, group)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x, cos, sin, meta: AttentionMetadata, kv_cache: KVCache,
                residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """x: the previous layer's MLP output, residual: the stream it adds to (None: x is the embedding,
        the first layer's input) -> (this layer's MLP output, the stream it adds to). As vLLM does, each
        residual add is left to the norm that reads its sum (RMSNorm.add_and_norm: one kernel pass)."""
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            residual, h = self.input_layernorm.add_and_norm(x, residual)
        h = self.self_attn(h, cos, sin, meta, kv_cache)
        residual, h = self.post_attention_layernorm.add_and_norm(h, residual)
        return self.mlp(h), residual


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, backend: AttentionBackend, layout: TPLayout, group: ParallelGroup,
                 attention_cls: type[Attention] = Attention,
                 mlp_for_layer: Callable[[int], nn.Module | None] = lambda i: None) -> None:  # fmt: skip
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(layout.vocab, config.hidden_size, group)
        self.layers = nn.ModuleList(
            DecoderLayer(config, backend, layout, group, attention_cls, mlp_for_layer(i))
            for i in range(config.num_hidden_layers)
        )
        for i, layer in enumerate(self.layers):
            layer.self_attn.sliding_window = config.window_of(i)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = RotaryEmbedding(config)
        self.fused: FusedDecoder | None = None  # set by LlamaForCausalLM.pack_weights where it applies
        self.batched: BatchedDecoder | None = None  # likewise: other bf16 steps (decode, prompt chunks)
        self.lora_context = None  # lora.apply.LoraContext once adapters are enabled (lora/layers.py install)

    def forward(self, input_ids, positions, meta: AttentionMetadata, kv_caches: Sequence[KVCache]) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        # The compiled whole-layer decoders know no adapters: steps with adapter rows take the per-op path.
        adapters = self.lora_context is not None and self.lora_context.batch is not None
        if not adapters and self.fused is not None and self.fused.applies(x, meta, kv_caches):
            # The fused layers compute in float32 whatever the weights' dtype.
            cos, sin = self.rotary.cos_sin(positions, torch.float32)
            return self.norm(self.fused(x, cos, sin, meta, kv_caches))
        # One cos/sin for all layers: positions do not change inside a forward.
        cos, sin = self.rotary.cos_sin(positions, x.dtype)
        if not adapters and self.batched is not None and self.batched.applies(x, meta, kv_caches):
            x, residual = self.batched(x, cos, sin, meta, kv_caches)  # the loop below, one call per layer
            return self.norm.add_and_norm(x, residual)[1]
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            x, residual = layer(x, cos, sin, meta, kv_cache, residual)
        return self.norm.add_and_norm(x, residual)[1]


class LlamaForCausalLM(nn.Module):
    # What subclasses change: the attention module, the decoder stack (gemma.py), and which
    # checkpoint projections are fused at load.
    attention_cls: type[Attention] = Attention
    model_cls: type[nn.Module] = LlamaModel
    stacked_params: dict[str, tuple[str, int]] = STACKED_PARAMS
    impl = "native"  # what /info says runs the model (models/transformers_backend.py: "transformers")

    def __init__(
        self, config: ModelConfig, backend: AttentionBackend | None = None, group: ParallelGroup | None = None
    ) -> None:
        """group: the tensor-parallel group this rank belongs to (None: one unsharded process)."""
        super().__init__()
        if backend is None:
            from pagemill.attention.torch_backend import TorchAttentionBackend

            backend = TorchAttentionBackend()
        self.config = config
        self.group = group or ParallelGroup.single()
        self.layout = TPLayout.build(
            config.num_attention_heads, config.num_key_value_heads, config.intermediate_size, config.vocab_size,
            self.group.world_size, self.group.rank,
        )  # fmt: skip
        if self.model_cls is LlamaModel:  # MoE layers (moe.py) plug in through mlp_for_layer
            self.model = LlamaModel(config, backend, self.layout, self.group, self.attention_cls, self.mlp_for_layer)
        else:
            self.model = self.model_cls(config, backend, self.layout, self.group, self.attention_cls)
        self.lm_head = ParallelLMHead(config.hidden_size, self.layout.vocab, config.vocab_size, self.group)
        self.tie_weights()

    def mlp_for_layer(self, index: int) -> nn.Module | None:
        """Layer `index`'s feed-forward block, or None for the dense MLP (models/moe.py overrides)."""
        return None

    def tie_weights(self) -> None:
        """Shares the embedding with the output projection when the config says so.

        Must be re-run after anything that re-creates parameters (to_empty).
        """
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def pack_weights(self, cpu_kernels: bool = True) -> int:
        """Builds the CPU-packed weight copies (see packed_linear) and, with cpu_kernels, the
        single-token fused decode (see fused_decode); call after loading."""
        from pagemill.models.gguf.linear import holds_gguf_weights, pack_gguf

        n = pack_all(self, cpu_kernels) + pack_gguf(self, cpu_kernels)
        for m in self.modules():
            if type(m) is MLP:  # subclasses (GeGLU) have their own activation
                m.swiglu = None
                if cpu_kernels:
                    m.pack_swiglu()
        self.model.fused = None
        if isinstance(self.model, LlamaModel):
            self.model.batched = None
        norm = elementwise = None
        if cpu_kernels:
            from pagemill.cpu_kernels.decode import decode_kernels
            from pagemill.cpu_kernels.rowwise import elementwise_kernels, norm_kernel

            # A model holding GGUF blocks has its own whole-layer decoder (fused_decode.GGUFFusedDecoder).
            if not holds_gguf_weights(self):
                self.model.fused = FusedDecoder.build(self, decode_kernels())
                if isinstance(self.model, LlamaModel):
                    self.model.batched = BatchedDecoder.build(self, decode_kernels())
            else:
                self.model.fused = GGUFFusedDecoder.build(self, decode_kernels())
            if self.model.norm.weight.device.type == "cpu":
                norm, elementwise = norm_kernel(), elementwise_kernels()
        for m in self.modules():
            if type(m) is RMSNorm:  # subclasses (other norms) compute their own way
                m.kernel = norm
            elif type(m) is MLP:  # subclasses (GeGLU) have their own activation
                m.kernels = elementwise
            elif isinstance(m, Attention):
                m.kernels = elementwise
        return n

    @property
    def num_kv_heads(self) -> int:
        """KV heads this rank holds in its pool."""
        return self.layout.heads.kv.size

    def checkpoint_targets(self, name: str) -> list[WeightTarget]:
        """Every part of this rank's parameters that checkpoint tensor `name` fills (phi3.py: several)."""
        return [self.checkpoint_target(name)]

    def checkpoint_names(self) -> set[str]:
        """What a complete checkpoint holds, in its own (HF) names: our parameter names with each
        fused parameter replaced by its parts."""
        params = dict(self.named_parameters(remove_duplicate=False))
        names = set(params)
        for layer in range(len(self.model.layers)):
            for hf, (ours, _) in self.stacked_params.items():
                for leaf in ("weight", "bias"):
                    fused = f"model.layers.{layer}.{ours}.{leaf}"
                    if fused in params:
                        names.discard(fused)
                        names.add(f"model.layers.{layer}.{hf}.{leaf}")
        return names

    def checkpoint_target(self, name: str) -> WeightTarget:
        """Where checkpoint tensor `name` goes on this rank, and which part of it this rank reads."""
        prefix, _, leaf = name.rpartition(".")  # leaf: weight / bias
        lay, d = self.layout, self.config.head_dim
        q, kv, inter = lay.heads.q, lay.heads.kv, lay.intermediate
        for hf, (ours, part) in self.stacked_params.items():
            if prefix.endswith("." + hf):
                target = f"{prefix[: -len(hf)]}{ours}.{leaf}"
                if ours == "self_attn.qkv_proj":  # rows: [q heads | k heads | v heads] of this rank
                    heads = q if part == 0 else kv
                    first = [0, q.size, q.size + kv.size][part] * d
                    return WeightTarget(target, Range(first, heads.size * d), 0, Range(heads.start * d, heads.size * d))
                return WeightTarget(target, Range(part * inter.size, inter.size), 0, inter)  # gate | up
        if name.endswith("self_attn.o_proj.weight"):  # row-parallel: this rank's heads are input columns
            return WeightTarget(name, None, 1, Range(q.start * d, q.size * d))
        if name.endswith("mlp.down_proj.weight"):
            return WeightTarget(name, None, 1, inter)
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            real = lay.vocab_real  # the padding rows past it stay unloaded (never read: see parallel/embedding.py)
            return WeightTarget(name, Range(0, real.size), 0, real)
        return WeightTarget(name, None, 0, None)  # replicated: norms, row-parallel biases

    def set_backend(self, backend: AttentionBackend) -> None:
        for layer in self.model.layers:
            layer.self_attn.backend = backend

    @property
    def backend(self) -> AttentionBackend:
        return self.model.layers[0].self_attn.backend

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn_metadata: AttentionMetadata,
        kv_caches: Sequence[KVCache],
        lora=None,
    ) -> torch.Tensor:
        """input_ids/positions [T] -> final hidden states [T, hidden]. lora: the step's
        lora.apply.LoraBatch (which rows use which adapter; None: the base model alone)."""
        if lora is None:
            return self.model(input_ids, positions, attn_metadata, kv_caches)
        ctx = getattr(self, "lora_context", None)
        if ctx is None:
            raise RuntimeError("a step with adapter rows on a model without LoRA layers (lora/layers.py install)")
        ctx.batch = lora
        try:
            return self.model(input_ids, positions, attn_metadata, kv_caches)
        finally:
            ctx.batch = None

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> float32 logits [N, vocab]."""
        return self.head_logits(hidden).float()

    def head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """compute_logits in the head's own dtype (bfloat16 models: bfloat16), for consumers that
        widen exactly where they read (the sampler): at 64 rows the float32 copy of
        [64, 49152] logits cost ~2 ms per decode step."""
        return self.lm_head(hidden)
