"""model_type -> the module class that runs it (config.SUPPORTED_MODEL_TYPES lists the same keys)."""

from __future__ import annotations

from pagemill.models.config import SUPPORTED_MODEL_TYPES, ModelConfig
from pagemill.models.gemma import GemmaForCausalLM
from pagemill.models.llama import LlamaForCausalLM
from pagemill.models.moe import MixtralForCausalLM, MoeForCausalLM, Qwen3MoeForCausalLM
from pagemill.models.phi3 import Phi3ForCausalLM
from pagemill.models.qwen3 import Qwen3ForCausalLM

MODEL_CLASSES: dict[str, type[LlamaForCausalLM]] = {
    "llama": LlamaForCausalLM,
    "mistral": LlamaForCausalLM,
    "qwen2": LlamaForCausalLM,  # its q/k/v biases are config.attention_bias
    "qwen3": Qwen3ForCausalLM,
    "phi3": Phi3ForCausalLM,
    "mixtral": MixtralForCausalLM,
    "qwen2_moe": MoeForCausalLM,
    "qwen3_moe": Qwen3MoeForCausalLM,
    "gemma2": GemmaForCausalLM,
    "gemma3_text": GemmaForCausalLM,
}
assert set(MODEL_CLASSES) == set(SUPPORTED_MODEL_TYPES)


def model_class(config: ModelConfig) -> type[LlamaForCausalLM]:
    return MODEL_CLASSES[config.model_type]
