#!/usr/bin/env bash
# The recipe and its TRL comparison on one 4-GPU (or 6+-GPU) host, in one command, within 9.5 minutes:
#
#   OUT=/tmp/out RECIPE_WORK=/root/recipe PYTHONPATH=/tmp/site:/root/vsite bash examples/recipes/run_gpu.sh
#
#   phase 1  GPU 0    build the ~100M model + data, SFT until validation exact match >= SFT_TARGET_EM (or for
#                     SFT_STEPS steps; SFT_SECONDS caps it) -> $RECIPE_WORK/sft/final, then the same run goes on as
#                     the more-SFT control for RL_SECONDS
#            GPU 1-3  GRPO, PPO, REINFORCE++ from sft/final, RL_SECONDS each, held-out exact match every 30 s
#   phase 2  the head-to-head from the same checkpoint, same settings, the same seconds each: TRL's GRPOTrainer
#            with vLLM colocated (trl_grpo) and relayrl's GRPO (grpo_vs_trl), evaluated every H2H_EVAL_SECONDS.
#            6+ GPUs: on GPUs 4 and 5, starting with phase 1's RL runs, TRL_SECONDS each. 4-5 GPUs: after phase 1
#            on GPUs 3 (TRL) and 1, for what the deadline leaves (at most TRL_SECONDS); TRL's trainer is built
#            during the SFT phase on GPU 3, idle then (REINFORCE++ starts there once it is built)
#   then     $OUT/curves.png, $OUT/h2h.png, $OUT/results.{md,json}, $OUT/logs.tar.gz (every log, curve,
#            metrics.jsonl, sft.json, TRL's summary.json); no weights
#
# Environment (defaults for 4-5 GPUs / 6+ GPUs): OUT (runs/recipe), RECIPE_WORK (/root/recipe), SCALE (full),
# SFT_TARGET_EM (the scale's 0.45), SFT_STEPS (0: the target rule), SFT_SECONDS (the scale's cap, 150),
# SFT_ROWS (0: 2000), RL_SECONDS (240 / 300), TRL_SECONDS (150 / RL_SECONDS), H2H_EVAL_SECONDS (15 / 30),
# H2H (1; 0: no phase 2), H2H_MIN_SECONDS (45: a shorter head-to-head is skipped), TRL_WAIT_S (200: on 4 GPUs,
# REINFORCE++ starts on TRL's GPU once TRL's trainer is built, or at this second at the latest), THREADS (8 CPU threads per job), DEADLINE_S (545: every job is killed by then; the
# plot gets 15 s more), PYTHON (python3), REUSE_SFT=1 (no build, SFT or control: RL runs from the existing
# $RECIPE_WORK/sft/final), RECIPE_DEVICE (cuda; cpu with SCALE=tiny and a stub nvidia-smi: a smoke test),
# TRL_ARGS (more trl_recipe.py arguments; "--cpu-smoke --max-steps 2" in the CPU smoke test).
# PYTHONPATH as given reaches TRL's side only (trl + datasets + vLLM 0.26); relayrl's runs use the repository
# and the image's packages.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-runs/recipe}
RECIPE_WORK=${RECIPE_WORK:-/root/recipe}
SCALE=${SCALE:-full}
DEADLINE_S=${DEADLINE_S:-545}
PY=${PYTHON:-$(command -v python3 || command -v python)}
DEVICE=${RECIPE_DEVICE:-cuda}
THREADS=${THREADS:-8}
TRL_PYTHONPATH=${PYTHONPATH:-}
export TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_ENABLE_V1_MULTIPROCESSING=0
export OMP_NUM_THREADS=$THREADS MKL_NUM_THREADS=$THREADS  # 4-6 jobs share the host: no job takes every core
mkdir -p "$OUT/logs" "$RECIPE_WORK"
T0=$(date +%s)
elapsed() { echo $(($(date +%s) - T0)); }
left() { local s=$((DEADLINE_S - $(elapsed))); echo $((s > 1 ? s : 1)); }

NGPU=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
if [ "$NGPU" -lt 4 ]; then
  echo "recipe: run_gpu.sh needs 4 GPUs (SFT + control on 0, one RL run on each of 1-3); found $NGPU" >&2
  exit 2
fi
if [ "$NGPU" -ge 6 ]; then BESIDE=1; RL_SECONDS=${RL_SECONDS:-300}; else BESIDE=0; RL_SECONDS=${RL_SECONDS:-240}; fi
TRL_SECONDS=${TRL_SECONDS:-$([ "$BESIDE" = 1 ] && echo "$RL_SECONDS" || echo 150)}
H2H_EVAL_SECONDS=${H2H_EVAL_SECONDS:-$([ "$BESIDE" = 1 ] && echo 30 || echo 15)}
H2H=${H2H:-1}
ARGS=(--scale "$SCALE" --work "$RECIPE_WORK" --out "$OUT" --device "$DEVICE" --sft-rows "${SFT_ROWS:-0}"
  --sft-seconds "${SFT_SECONDS:-0}" --sft-steps "${SFT_STEPS:-0}" --sft-target-em "${SFT_TARGET_EM:-0}")
RECIPE=(env "PYTHONPATH=$PWD" "$PY" examples/recipes/recipe.py)
echo "recipe: $NGPU GPU(s); OUT=$OUT RECIPE_WORK=$RECIPE_WORK; RL ${RL_SECONDS}s each; head-to-head" \
  "$([ "$H2H" = 1 ] || echo 'off')$([ "$H2H" = 1 ] && [ "$BESIDE" = 1 ] && echo "beside phase 1, ${TRL_SECONDS}s")$(
  [ "$H2H" = 1 ] && [ "$BESIDE" = 0 ] && echo "after phase 1, <= ${TRL_SECONDS}s"); deadline ${DEADLINE_S}s"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader > "$OUT/logs/gpus.txt" 2>&1
"$PY" -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" \
  > "$OUT/logs/versions.txt" 2>&1
echo "host: $(nproc) CPUs; $THREADS threads per job; started $(date -u +%FT%TZ)" >> "$OUT/logs/versions.txt"

# ------------------------------------------------------------------------------------------- the head-to-head's processes
# Both start now (their imports overlap phase 1) and wait until $GO holds their budget. Meanwhile TRL builds its
# trainer (vLLM's start-up, ~90 s, outside its clock) from the base model as soon as the data exist, on a GPU that
# is idle until the SFT checkpoint appears, and loads the SFT weights once $GO appears; relayrl's side touches no
# GPU before $GO.
GO="$RECIPE_WORK/trl.go"
rm -f "$GO" "$RECIPE_WORK/trl.ready"
if [ "${REUSE_SFT:-0}" = 1 ] && [ -d "$RECIPE_WORK/sft/final" ]; then
  [ -d "$RECIPE_WORK/base" ] && touch "$RECIPE_WORK/prepared"  # (a folder an older version of the recipe wrote)
else
  rm -f "$RECIPE_WORK/prepared"
fi
if [ "$BESIDE" = 1 ]; then TRL_GPU=4; H2H_GPU=5; else TRL_GPU=3; H2H_GPU=1; fi
trl_pid=""
h2h_pid=""
if [ "$H2H" = 1 ]; then
  NEED="'trl', 'datasets'$(case " ${TRL_ARGS:-} " in *" --cpu-smoke "*) ;; *) echo ", 'vllm'";; esac)"
  if PYTHONPATH="$TRL_PYTHONPATH" "$PY" -c "import importlib.util as u, sys
sys.exit(0 if all(u.find_spec(m) for m in ($NEED,)) else 1)" 2>/dev/null; then
    CUDA_VISIBLE_DEVICES=$TRL_GPU PYTHONPATH="$TRL_PYTHONPATH${TRL_PYTHONPATH:+:}$PWD" \
      timeout -k 10 "$(left)" "$PY" -m torch.distributed.run --standalone --nproc_per_node 1 \
      examples/recipes/trl_recipe.py --work "$RECIPE_WORK" --out "$OUT" --budget-s "$TRL_SECONDS" \
      --eval-seconds "$H2H_EVAL_SECONDS" --start-after "$GO" --start-timeout "$DEADLINE_S" ${TRL_ARGS:-} \
      > "$OUT/logs/trl_grpo.log" 2>&1 &
    trl_pid=$!
    CUDA_VISIBLE_DEVICES=$H2H_GPU timeout -k 10 "$(left)" "${RECIPE[@]}" rl --algo grpo --run-name grpo_vs_trl \
      "${ARGS[@]}" --rl-seconds "$TRL_SECONDS" --eval-seconds "$H2H_EVAL_SECONDS" --start-after "$GO" \
      > "$OUT/logs/grpo_vs_trl.log" 2>&1 &
    h2h_pid=$!
  else
    echo "recipe: trl / datasets / vllm not importable with PYTHONPATH=$TRL_PYTHONPATH: no head-to-head" >&2
    H2H=0
  fi
fi

# ------------------------------------------------------------------------------------------- phase 1
pids=()
if [ "${REUSE_SFT:-0}" = 1 ] && [ -d "$RECIPE_WORK/sft/final" ]; then
  echo "recipe: reusing $RECIPE_WORK/sft/final (no build, no SFT, no control)"
else
  rm -rf "$RECIPE_WORK/sft" "$RECIPE_WORK/sft.failed"
  # a failed build / SFT leaves sft.failed: the RL runs waiting for the checkpoint then stop at once
  ( CUDA_VISIBLE_DEVICES=0 timeout -k 10 "$(left)" "${RECIPE[@]}" prepare-sft "${ARGS[@]}" --rl-seconds "$RL_SECONDS" \
    || { rc=$?; [ -d "$RECIPE_WORK/sft/final" ] || touch "$RECIPE_WORK/sft.failed"; exit $rc; } ) \
    > "$OUT/logs/sft.log" 2>&1 &
  pids+=($!)
fi
gpu=1
for algo in grpo ppo reinforce++; do
  if [ "$gpu" = "$TRL_GPU" ] && [ -n "$trl_pid" ]; then
    # vLLM must not start on a GPU where another process frees memory (its start-up check fails): this run
    # waits for TRL's trainer (or TRL's end); it waits for the SFT checkpoint anyway
    # waits for TRL's trainer at most until TRL_WAIT_S after the start (then TRL may fail, not the recipe)
    while [ ! -e "$RECIPE_WORK/trl.ready" ] && kill -0 "$trl_pid" 2>/dev/null && [ "$(elapsed)" -lt "${TRL_WAIT_S:-200}" ]; do
      sleep 1; done
    echo "recipe: $algo starts on GPU $gpu after $(elapsed)s (TRL's trainer $([ -e "$RECIPE_WORK/trl.ready" ] \
      && echo "built in $(cat "$RECIPE_WORK/trl.ready")s" || echo 'not built'))"
  fi
  # each waits for the SFT checkpoint itself (its imports overlap the SFT run)
  CUDA_VISIBLE_DEVICES=$gpu timeout -k 10 "$(left)" "${RECIPE[@]}" rl --algo "$algo" "${ARGS[@]}" \
    --rl-seconds "$RL_SECONDS" > "$OUT/logs/$algo.log" 2>&1 &
  pids+=($!)
  gpu=$((gpu + 1))
done
if [ "$H2H" = 1 ] && [ "$BESIDE" = 1 ]; then  # the head-to-head starts with phase 1's RL runs
  while [ ! -d "$RECIPE_WORK/sft/final" ] && [ ! -e "$RECIPE_WORK/sft.failed" ] && [ "$(left)" -gt 60 ]; do
    sleep 1; done
  if [ -d "$RECIPE_WORK/sft/final" ]; then echo "$TRL_SECONDS" > "$GO"; else echo abort > "$GO"; fi
fi

status=0
for pid in "${pids[@]}"; do wait "$pid" || status=$?; done
echo "recipe: phase 1 done after $(elapsed)s (last non-zero exit: $status)"

if [ "$H2H" = 1 ] && [ "$BESIDE" = 0 ]; then  # the head-to-head after phase 1, as long as the deadline allows
  T=$(( $(left) - 35 ))
  T=$(( T < TRL_SECONDS ? T : TRL_SECONDS ))
  if [ -d "$RECIPE_WORK/sft/final" ] && [ -e "$RECIPE_WORK/trl.ready" ] && [ "$T" -ge "${H2H_MIN_SECONDS:-45}" ]; then
    echo "recipe: head-to-head, ${T}s each: TRL on GPU $TRL_GPU, relayrl on GPU $H2H_GPU"
    echo "$T" > "$GO"
  else
    echo "recipe: no head-to-head (${T}s left for it, TRL's trainer $([ -e "$RECIPE_WORK/trl.ready" ] \
      || echo 'not ')built)" >&2
    echo abort > "$GO"
  fi
fi
for pid in $h2h_pid $trl_pid; do wait "$pid" || status=$?; done
echo "recipe: runs done after $(elapsed)s (last non-zero exit: $status)"
for f in "$OUT"/logs/*.log; do echo "== $f (tail)"; tail -n 4 "$f"; done

timeout -k 5 15 env "PYTHONPATH=$PWD" "$PY" examples/recipes/plot.py "$OUT" || echo "recipe: plot failed" >&2
# what comes back stays small: the pictures, the tables, one tarball of logs, curves, metrics and summaries
tar -czf "$OUT/logs.tar.gz" -C "$OUT" --exclude=logs.tar.gz --exclude='*.png' --exclude=results.json \
  --exclude=results.md . && find "$OUT" -mindepth 1 -maxdepth 1 -type d -exec rm -rf {} +
echo "recipe: total $(elapsed)s; outputs in $OUT: $(ls "$OUT" | tr '\n' ' ')"
exit $status
