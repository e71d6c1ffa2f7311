#!/usr/bin/env bash
# The GPU tier: the recipes and commands on MLX's default device (a GPU: Metal, or a CUDA build),
# each step's wall time and GPU busy %, and the same run with device=cpu for comparison.
#
#   bash scripts/gpu_check.sh [OUT_DIR] [STAGES]     STAGES: quick,fixture,fixturecpu,eval,big,tune,serve
#                                                    (default all but tune, which big's recipe covers)
#
# Writes OUT_DIR/summary.tsv (stage, device, seconds, GPU busy % mean/max, exit code) and a log per
# run. Needs MLX with a GPU; GPU busy % needs nvidia-smi (CUDA) and is "-" elsewhere.
set -uo pipefail
OUT=${1:-outputs/gpu_check}
STAGES=${2:-quick,fixture,fixturecpu,eval,big,serve}
PY=${PY:-python3}
mkdir -p "$OUT"
SUMMARY=$OUT/summary.tsv
[ -f "$SUMMARY" ] || printf "stage\tdevice\tseconds\tgpu_mean\tgpu_max\texit\n" > "$SUMMARY"
FIXTURE=tests/fixtures/llama-narrow-8l
COMMON=(paths.outputs="$OUT/runs" registry.path="$OUT/registry.db")

# run NAME DEVICE ARGS...: one command, timed, with the GPU's utilization sampled every 200 ms
run() {
  local name=$1 device=$2; shift 2
  local log=$OUT/$name-$device.log smi=$OUT/$name-$device.smi
  local sampler=
  if command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=utilization.gpu --format=csv,noheader,nounits -lms 200 > "$smi" 2>/dev/null &
    sampler=$!
  fi
  local t0=$(date +%s%N)
  "$PY" -m mlxbun "$@" device="$device" "${COMMON[@]}" paths.cache="$OUT/cache-$device" > "$log" 2>&1
  local rc=$?
  local secs=$(awk -v a="$t0" -v b="$(date +%s%N)" 'BEGIN {print (b - a) / 1e9}')
  [ -n "$sampler" ] && kill "$sampler" 2>/dev/null
  local mean=- max=-
  if [ -s "$smi" ]; then
    mean=$(awk '{s+=$1; n++} END {printf "%.0f", s/n}' "$smi")
    max=$(sort -n "$smi" | tail -1)
  fi
  printf "%s\t%s\t%.1f\t%s\t%s\t%s\n" "$name" "$device" "$secs" "$mean" "$max" "$rc" | tee -a "$SUMMARY"
  grep -v " INFO " "$log" | tail -3
}

has() { [[ ",$STAGES," == *",$1,"* ]]; }

"$PY" -c "import mlx.core as mx; print('mlx', mx.__version__, mx.default_device())"

if has quick; then
  run quickstart gpu +recipe=quickstart
  run quickstart cpu +recipe=quickstart
fi
if has fixture; then  # the best model at a size on a representative fixture
  run best-fixture gpu +recipe=best model.name=$FIXTURE allocate.budget_bpw=3.5 quant.out="$OUT/best-gpu"
fi
if has fixturecpu; then  # the same with the CPU forced, on the same machine
  run best-fixture cpu +recipe=best model.name=$FIXTURE allocate.budget_bpw=3.5 quant.out="$OUT/best-cpu"
fi
if has eval; then
  run eval gpu command=eval model.name=$FIXTURE "eval.candidates=[$(ls -d "$OUT"/best-gpu "$OUT"/best-cpu 2>/dev/null | paste -sd,)]"
fi
if has big; then  # Qwen2.5-0.5B's shapes, synthetic weights
  run synth-0.5b gpu command=synth synth.arch=qwen2 synth.hidden_size=896 synth.intermediate_size=4864 \
    synth.num_layers=24 synth.num_heads=14 synth.num_kv_heads=2 synth.head_dim=64 synth.vocab_size=151936 \
    synth.tie_embeddings=true synth.out="$OUT/q05"
  run best-0.5b gpu +recipe=best model.name="$OUT/q05" allocate.budget_bpw=4.5
fi
if has tune; then  # tune alone at Qwen2.5-0.5B's shapes under a small budget: the block loop on the GPU
  [ -d "$OUT/q05" ] || run synth-0.5b gpu command=synth synth.arch=qwen2 synth.hidden_size=896 \
    synth.intermediate_size=4864 synth.num_layers=24 synth.num_heads=14 synth.num_kv_heads=2 synth.head_dim=64 \
    synth.vocab_size=151936 synth.tie_embeddings=true synth.out="$OUT/q05"
  run quantize-0.5b gpu command=quantize model.name="$OUT/q05" quant.bits=4 quant.group_size=64 quant.out="$OUT/q05-q4"
  run tune-0.5b gpu command=tune model.name="$OUT/q05-q4" tune.reference="$OUT/q05" tune.max_minutes=2
fi
if has serve; then  # a few requests to command=serve, then the KV cache commands
  port=18421
  "$PY" -m mlxbun command=serve model.name=$FIXTURE serve.port=$port "${COMMON[@]}" paths.cache="$OUT/cache-gpu" > "$OUT/serve.log" 2>&1 &
  server=$!
  "$PY" - "$port" <<'PYEOF' | tee "$OUT/serve-answers.txt"
import json, sys, time, urllib.request
url = f"http://127.0.0.1:{sys.argv[1]}"
for _ in range(120):
    try:
        urllib.request.urlopen(url + "/health", timeout=2)
        break
    except OSError:
        time.sleep(1)
for i in range(3):
    body = json.dumps({"prompt": f"Once upon a time {i}", "max_tokens": 16}).encode()
    req = urllib.request.Request(url + "/v1/completions", body, {"content-type": "application/json"})
    print(urllib.request.urlopen(req, timeout=120).read().decode()[:300])
PYEOF
  kill "$server" 2>/dev/null; wait "$server" 2>/dev/null
  run kv-save gpu command=kv_save model.name=$FIXTURE kv.store="$OUT/kv" kv.name=check kv.prompt="The harbour town woke slowly"
  run kv-generate gpu command=kv_generate model.name=$FIXTURE kv.store="$OUT/kv" kv.name=check kv.max_tokens=16 \
    'kv.prompt="The harbour town woke slowly, and then"'
fi
cat "$SUMMARY"
