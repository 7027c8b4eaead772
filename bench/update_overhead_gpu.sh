#!/usr/bin/env bash
# The RL experience pass and update on one GPU, before vs after the host-overhead work ("Scale efficiency" /
# "Proof at GPU scale"): bench/update_overhead.py with the old settings (--baseline: every pass in
# 4096-token micro-batches) and with the defaults (automatic token budgets), on the GPU recipe's 103.9M Qwen2
# (char vocabulary, 64 x 8 samples of 60-136 tokens, as examples/recipes) and on the Qwen2.5-0.5B body
# (bench/rl_step.py's qwen0.5b-char, 64 x 8 samples of 100-256 tokens).
#
#   OUT=/tmp/hostcost bash bench/update_overhead_gpu.sh        # from the repository root, ~3 min on one H100
#
# Each pass follows one untimed rollout of the colocated native engine (so memory is as a real step leaves
# it). Per phase: median wall seconds, micro-batches, host reads, synchronising CUDA calls (sync debug mode),
# GPU busy time of one traced pass (torch.profiler), peak memory, allocator retries. Output: $OUT/
# update_overhead.json (one entry per shape / settings) and $OUT/log.txt. Each run has its own timeout, so a
# failure leaves the others' numbers.
# torch runs 8 intra-op threads (the GPU host is shared by several jobs; see docs/recipe.md on contention).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/bench/results/update_overhead_gpu}
export OUT
mkdir -p "$OUT"
PY=${PYTHON:-python3}
LOG=$OUT/log.txt
: > "$LOG"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader >> "$LOG" 2>&1

run() {  # run SECONDS ARGS...
  local limit=$1
  shift
  echo "=== $* (limit ${limit}s)" | tee -a "$LOG"
  timeout -k 10 "$limit" "$PY" bench/update_overhead.py --device cuda --threads 8 "$@" 2>&1 \
    | grep -v "Loading weights\|Writing model" | tee -a "$LOG"
  echo "=== exit ${PIPESTATUS[0]}" | tee -a "$LOG"
}

RECIPE=(--shape recipe100m --min-len 60 --max-len 136 --repeats 2)
run 100 "${RECIPE[@]}" --baseline
run 50 "${RECIPE[@]}"
HALF=(--shape qwen0.5b-char --repeats 2 --phases ref_logprobs,update)
run 75 "${HALF[@]}" --baseline
run 55 "${HALF[@]}"
echo "results: $OUT/update_overhead.json" | tee -a "$LOG"
