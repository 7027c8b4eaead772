#!/usr/bin/env bash
# The recipe on one 4-GPU host, in one command, under 9 minutes of wall time (model build included):
#
#   OUT=/tmp/out RECIPE_WORK=/root/recipe bash examples/recipes/run_gpu.sh
#
#   GPU 0   build the ~100M model + data, SFT for SFT_SECONDS -> $RECIPE_WORK/sft/final, then the same run
#           goes on as the more-SFT control for RL_SECONDS
#   GPU 1-3 GRPO, PPO, REINFORCE++ (relayrl presets), each starting as soon as $RECIPE_WORK/sft/final exists
#           and running RL_SECONDS of wall time, held-out exact match every 30 s
#   then    $OUT/curves.png, $OUT/results.{md,json} and $OUT/logs.tar.gz (logs, curves, metrics); no weights
#
# Environment: OUT (default runs/recipe), RECIPE_WORK (default /root/recipe: model, data, SFT checkpoint),
# SFT_SECONDS (125), RL_SECONDS (260), SFT_ROWS (0: the scale's 2000 demonstrations), SCALE (full),
# PYTHON (python3), REUSE_SFT=1 (skip the build and SFT when $RECIPE_WORK/sft/final exists: RL runs only, no
# control), DEADLINE_S (500: every job is killed by then, so the table and picture are always written from
# whatever the runs logged), RECIPE_DEVICE (cuda; cpu with SCALE=tiny and a stub nvidia-smi: a smoke test).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-runs/recipe}
RECIPE_WORK=${RECIPE_WORK:-/root/recipe}
SCALE=${SCALE:-full}
SFT_SECONDS=${SFT_SECONDS:-125}
RL_SECONDS=${RL_SECONDS:-260}
DEADLINE_S=${DEADLINE_S:-500}
PY=${PYTHON:-$(command -v python3 || command -v python)}
DEVICE=${RECIPE_DEVICE:-cuda}  # cpu: a smoke test of this script (with SCALE=tiny)
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
mkdir -p "$OUT/logs" "$RECIPE_WORK"
T0=$(date +%s)
left() { local s=$((DEADLINE_S - ($(date +%s) - T0))); echo $((s > 1 ? s : 1)); }
ARGS=(--scale "$SCALE" --work "$RECIPE_WORK" --out "$OUT" --sft-seconds "$SFT_SECONDS" --rl-seconds "$RL_SECONDS"
  --sft-rows "${SFT_ROWS:-0}")
RECIPE=("$PY" examples/recipes/recipe.py)

NGPU=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
echo "recipe: $NGPU GPU(s); OUT=$OUT RECIPE_WORK=$RECIPE_WORK SFT ${SFT_SECONDS}s, RL ${RL_SECONDS}s each"
if [ "$NGPU" -lt 4 ]; then
  echo "recipe: run_gpu.sh needs 4 GPUs (SFT + control on 0, one RL run on each of 1-3); found $NGPU" >&2
  exit 2
fi
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader > "$OUT/logs/gpus.txt" 2>&1
"$PY" -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" \
  > "$OUT/logs/versions.txt" 2>&1

pids=()
if [ "${REUSE_SFT:-0}" = 1 ] && [ -d "$RECIPE_WORK/sft/final" ]; then
  echo "recipe: reusing $RECIPE_WORK/sft/final (no build, no SFT, no control)"
else
  rm -rf "$RECIPE_WORK/sft" "$RECIPE_WORK/sft.failed"
  # a failed build / SFT leaves sft.failed: the RL runs waiting for the checkpoint then stop at once
  ( CUDA_VISIBLE_DEVICES=0 timeout -k 10 "$(left)" "${RECIPE[@]}" prepare "${ARGS[@]}" && \
    CUDA_VISIBLE_DEVICES=0 timeout -k 10 "$(left)" "${RECIPE[@]}" sft --device "$DEVICE" "${ARGS[@]}" \
    || { rc=$?; [ -d "$RECIPE_WORK/sft/final" ] || touch "$RECIPE_WORK/sft.failed"; exit $rc; } ) \
    > "$OUT/logs/sft.log" 2>&1 &
  pids+=($!)
fi
gpu=1
for algo in grpo ppo reinforce++; do
  # each waits for the SFT checkpoint itself (its imports overlap the SFT run)
  CUDA_VISIBLE_DEVICES=$gpu timeout -k 10 "$(left)" "${RECIPE[@]}" rl --algo "$algo" --device "$DEVICE" "${ARGS[@]}" \
    > "$OUT/logs/$algo.log" 2>&1 &
  pids+=($!)
  gpu=$((gpu + 1))
done
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=$?; done
echo "recipe: runs done after $(( $(date +%s) - T0 ))s (last non-zero exit: $status)"
for f in "$OUT"/logs/*.log; do echo "== $f (tail)"; tail -n 5 "$f"; done

timeout -k 5 25 "$PY" examples/recipes/plot.py "$OUT" || echo "recipe: plot failed" >&2
# what comes back stays small: the picture, the tables, one tarball of logs, curves and metrics
tar -czf "$OUT/logs.tar.gz" -C "$OUT" --exclude=logs.tar.gz --exclude=curves.png --exclude=results.json \
  --exclude=results.md . && rm -rf "$OUT/logs" "$OUT"/grpo "$OUT"/ppo "$OUT"/reinforce++ "$OUT"/sft_control
echo "recipe: total $(( $(date +%s) - T0 ))s; outputs in $OUT: $(ls "$OUT" | tr '\n' ' ')"
exit $status
