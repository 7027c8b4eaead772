#!/usr/bin/env bash
# GPU confirmation of the colocated refresh through the bucketed gather and the row store's 1 MiB blocks
# (docs/distributed.md, "What the sync and experience timings cover"). Needs 4 GPUs (2 for part 1), ray
# installed (bench/scale.py's 2- and 4-GPU cases are Ray FSDP2 groups); ~4-5 minutes; writes to $OUT:
#   refresh_gather.json    2 ranks, qwen0.5b-char: per-parameter / bucketed / per-unit gathers, and the engine
#                          refresh per unit (before) vs default (bucketed on CUDA, now): seconds, collectives,
#                          canary (must be 0.0), refresh_bitwise_equal (must be true)
#   scale/scale_syncexp.json   bench/scale.py rl --weak at 1, 2, 4 GPUs (4 first; 6 steps, medians of 5):
#                          timing/* per phase, incl. sync, engine_refresh, experience and timing/rows_put (the
#                          driver's row-store puts); a case cut short still has its row, marked partial
#   driver_step_threads{0,64,1}.json   the driver's own per-step work on this host's CPU at 2,048 samples (no GPU;
#                          run beside part 1): trajectories back, reward, collate, row-store puts, advantages,
#                          with run_rl's torch threads (0: at most 8 since 16:00), 64 (before) and 1; "host" = threads and usable CPUs
#   *.log                  each part's output
# Usage: OUT=/some/dir bash bench/sync_experience_gpu.sh
set -u
OUT="${OUT:?set OUT to the output folder}"
mkdir -p "$OUT/scale"
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY="${PYTHON:-python}"
echo "part 0 (CPU, beside part 1): the driver's own work at 2,048 samples, run_rl's threads and 1 thread" >&2
(
    for threads in 0 64 1; do
        timeout -k 3 30 "$PY" bench/driver_step.py --batches 2048 --response 108 --max-response 256 \
            --repeats 2 --threads "$threads" --out "$OUT/driver_step_threads$threads.json" \
            > "$OUT/driver_step_threads$threads.log" 2>&1
        echo "part 0 (threads $threads) exit $?" >&2
    done
) &
part0=$!
echo "part 1: refresh gather, 2 ranks" >&2
timeout -k 5 55 "$PY" -m torch.distributed.run --standalone --nproc_per_node=2 bench/refresh_gather.py \
    --shape qwen0.5b-char --reps 5 --time-limit 50 > "$OUT/refresh_gather.log" 2>&1
echo "part 1 exit $?" >&2
wait "$part0"
echo "part 2: RL weak scaling 1, 2, 4 GPUs (the 4-GPU case first)" >&2
# ~3 min: model build ~15 s; 4 GPUs ~60 s start-up + 6 x ~1.5 s; 2 GPUs ~50 + 6 x ~1.45; 1 GPU ~15 + 6 x ~1.2.
# The budget keeps 50 + 40 s (--case-min's default on cuda: 30 + 10 x GPUs) for the 2- and 1-GPU cases while
# the 4-GPU case runs, so the 4-GPU case gets >= 120 s and the whole part ends within 225 s.
timeout -k 5 235 "$PY" bench/scale.py rl --shape qwen0.5b-char --gpus 1,2,4 --weak --budget 0 --steps 6 \
    --case-timeout 150 --time-budget 225 --out "$OUT/scale" --tag syncexp > "$OUT/scale.log" 2>&1
echo "part 2 exit $?" >&2
