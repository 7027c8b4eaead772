#!/usr/bin/env bash
# The scale-efficiency tables (bench/scale.py, one scale.py call per table) on a 4-GPU host, in groups that each
# fit one <= 9-minute call. Needs ray (e.g. PYTHONPATH=/tmp/site). Writes to $OUT/scale_tables/:
#   scale_<tag>.json  one table each (rows by GPU count; medians of 5 timed steps, min and spread; partial rows
#                     of cases cut short), scale.json (keyed results), <tag>.log (each table's output)
#
#   group A (~6.5 min, at most 7.7): rl_weak_05   RL weak 0.5B-char 1,2,4 (64 x 8 per GPU)        ~3.2 min
#                                    sft_weak_05  SFT weak 0.5B 1,2,4 (64 samples per GPU, 16k)    ~3 min
#   group B (~8 min, at most 9):     rl_weak_15   RL weak 1.5B-char 1,2,4 (64 x 8 per GPU)        ~4.5 min
#                                    sft_weak_15  SFT weak 1.5B 1,2,4 (64 per GPU, 8k micro-batches) ~3.5 min
#   group C (~7 min, at most 9):     rl_strong_15 RL strong 1.5B-char 64 x 8 at 1,2,4             ~4 min
#                                    7b_grpo_ref  7B GRPO + reference, 4 GPUs, 16 x 4 x 128        ~3 min
#   group D (~5 min, at most 7.5):   7b_ppo       7B PPO + critic + reference, 4 GPUs, grad ckpt  ~4-5 min
#   group R (~6.5 min, at most 7.7): rl_weak_05_rep, sft_weak_05_rep   group A with --replicate (dist.replicate)
#   group S (~8 min, at most 9.3):   rl_weak_15_rep, rl_strong_15_rep  RL 1.5B weak and strong, --replicate
# Every table has a --time-budget (the build included) and an outer timeout 10 s above it, so a group never
# runs past its "at most"; a case cut short still writes its row (partial), a case that cannot get its
# --case-min is not started.
# Usage: OUT=/some/dir bash bench/scale_tables_gpu.sh A   (or B, C, D, R, S; several: A B)
# CPU smoke of the script itself: SCALE_EXTRA="--device cpu --shape tiny --gpus 1 --prompts 2 --samples 2
#   --new-tokens 4 --batch 4" (appended to every scale.py call: later flags win)
set -u
OUT="${OUT:?set OUT to the output folder}"
DIR="$OUT/scale_tables"
mkdir -p "$DIR"
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY="${PYTHON:-python}"

table() {  # table <tag> <time budget s> <scale.py args...>
    local tag=$1 budget=$2
    shift 2
    echo "$(date -u +%H:%M:%S) $tag (budget ${budget} s)" >&2
    # shellcheck disable=SC2086  # SCALE_EXTRA is a list of flags
    timeout -k 5 $((budget + 10)) "$PY" bench/scale.py "$@" --time-budget "$budget" --out "$DIR" --tag "$tag" \
        ${SCALE_EXTRA:-} > "$DIR/$tag.log" 2>&1
    local rc=$?
    echo "$(date -u +%H:%M:%S) $tag exit $rc" >&2
    tail -6 "$DIR/$tag.log" >&2
}

for group in "${@:-A}"; do
    case "$group" in
    A)
        table rl_weak_05 230 rl --shape qwen0.5b-char --gpus 1,2,4 --weak --budget 0 --case-timeout 150
        table sft_weak_05 210 sft --shape qwen0.5b --gpus 1,2,4 --weak --budget 16384 --case-timeout 130
        ;;
    B)
        table rl_weak_15 285 rl --shape qwen1.5b-char --gpus 1,2,4 --weak --budget 0 --case-timeout 180
        table sft_weak_15 235 sft --shape qwen1.5b --gpus 1,2,4 --weak --budget 8192 --case-timeout 150
        ;;
    C)
        table rl_strong_15 270 rl --shape qwen1.5b-char --gpus 1,2,4 --budget 0 --case-timeout 170
        table 7b_grpo_ref 245 rl --shape qwen7b-char --gpus 4 --algo grpo_ref --prompts 16 --samples 4 \
            --new-tokens 128 --budget 4096 --case-min 150 --case-timeout 240
        ;;
    D)
        table 7b_ppo 430 rl --shape qwen7b-char --gpus 4 --algo ppo_critic --grad-ckpt --prompts 16 --samples 4 \
            --new-tokens 128 --budget 4096 --case-min 200 --case-timeout 420
        ;;
    R)
        table rl_weak_05_rep 230 rl --shape qwen0.5b-char --gpus 1,2,4 --weak --budget 0 --case-timeout 150 \
            --replicate
        table sft_weak_05_rep 210 sft --shape qwen0.5b --gpus 1,2,4 --weak --budget 16384 --case-timeout 130 \
            --replicate
        ;;
    S)
        table rl_weak_15_rep 285 rl --shape qwen1.5b-char --gpus 1,2,4 --weak --budget 0 --case-timeout 180 \
            --replicate
        table rl_strong_15_rep 270 rl --shape qwen1.5b-char --gpus 1,2,4 --budget 0 --case-timeout 170 \
            --replicate
        ;;
    *) echo "unknown group $group (A, B, C, D, R or S)" >&2 ;;
    esac
done
