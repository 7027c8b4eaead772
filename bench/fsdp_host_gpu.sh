#!/usr/bin/env bash
# The host time a sharded (FSDP2) training step adds at 2 and 4 GPUs, before / after relayrl/training/sharded.py's
# changes (bench/fsdp_host.py), against the 1-GPU step: Qwen2.5-0.5B body with the char vocabulary, 512 samples
# of 40-240 tokens a rank (about the RL weak-scaling run's 64 x 8 per GPU), micro-batches of <= 16,384 tokens.
#
#     OUT=/some/dir bash bench/fsdp_host_gpu.sh        (PYTHON=... for another interpreter; default python)
#
# Parts (each under its own timeout; a failing part leaves the others' results; later parts are skipped when
# the whole script passed its budget): 1 GPU plain (the 1-GPU product path), 2 ranks, 4 ranks (when 4 GPUs),
# FSDP2 over 1 GPU (its hooks without peers). Writes $OUT/fsdp_host_<label>.json and $OUT/<label>.log.
set -u
PY=${PYTHON:-python}
OUT=${OUT:-bench/results/fsdp_host_gpu}
mkdir -p "$OUT"
export OUT
cd "$(dirname "$0")/.."
if command -v torchrun >/dev/null 2>&1; then TR=(torchrun); else TR=("$PY" -m torch.distributed.run); fi
NG=${NGPUS:-$("$PY" -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)}
START=$(date +%s)
BUDGET=${BUDGET_S:-225}
# DEVICE=cpu SHAPE=host SAMPLES=12 BUDGET_TOKENS=256 NGPUS=2: the same parts on CPU ranks (a dry run of the script)
COMMON=(--device "${DEVICE:-cuda}" --shape "${SHAPE:-qwen0.5b-char}" --samples "${SAMPLES:-512}" --min-len 40
        --max-len 240 --budget "${BUDGET_TOKENS:-16384}" --steps 6 --time-limit 40)
echo "GPUs: $NG; $("$PY" -c 'import torch; print(torch.__version__, torch.cuda.get_device_name(0))' 2>&1 | tail -1)" \
  | tee "$OUT/summary.txt"

part() {  # part LABEL TIMEOUT COMMAND...
  local label=$1 limit=$2; shift 2
  local used=$(( $(date +%s) - START ))
  if (( used + limit > BUDGET + 30 )); then
    echo "$label: skipped (script at ${used}s of its ${BUDGET}s budget)" | tee -a "$OUT/summary.txt"
    return
  fi
  local t0=$(date +%s)
  timeout -k 10 "$limit" "$@" --label "$label" > "$OUT/$label.log" 2>&1
  local rc=$?
  echo "$label: rc $rc in $(( $(date +%s) - t0 ))s" | tee -a "$OUT/summary.txt"
  grep -A12 "^$label:" "$OUT/$label.log" | tee -a "$OUT/summary.txt"
  (( rc == 0 )) || tail -5 "$OUT/$label.log" | tee -a "$OUT/summary.txt"
}

part gpu_local_w1 60 env CUDA_VISIBLE_DEVICES=0 "$PY" bench/fsdp_host.py "${COMMON[@]}"
if (( NG >= 2 )); then
  part gpu_w2 80 env CUDA_VISIBLE_DEVICES=0,1 "${TR[@]}" --standalone --nproc_per_node=2 bench/fsdp_host.py \
    "${COMMON[@]}" --profile 2
fi
if (( NG >= 4 )); then
  part gpu_w4 80 env CUDA_VISIBLE_DEVICES=0,1,2,3 "${TR[@]}" --standalone --nproc_per_node=4 \
    bench/fsdp_host.py "${COMMON[@]}"
fi
part gpu_fsdp1 50 env CUDA_VISIBLE_DEVICES=0 "${TR[@]}" --standalone --nproc_per_node=1 bench/fsdp_host.py \
  "${COMMON[@]}" --fsdp1
echo "done in $(( $(date +%s) - START ))s" | tee -a "$OUT/summary.txt"
