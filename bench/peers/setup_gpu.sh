#!/usr/bin/env bash
# Install the peers' carried wheels on the GPU machine and check that everything the peer benchmarks need
# imports, printing each failure's exact error (the last lines of its traceback). Exit code 0 only when all
# checks pass; the installs and checks run under timeouts.
#   bash bench/peers/setup_gpu.sh WHEELS TARGET      # WHEELS holds verl/ and openrlhf/ (bench/peers/build_wheels.sh)
# Ray and vLLM are expected on PYTHONPATH already (the project's carried ray wheels and vLLM bundle); after this
# script, `export PYTHONPATH=TARGET:$PYTHONPATH` (the script prints the line).
set -uo pipefail
wheels=${1:?usage: setup_gpu.sh WHEELS TARGET}
target=${2:?usage: setup_gpu.sh WHEELS TARGET}
py=${PY:-python3}
mkdir -p "$target"
fail=0
for set in verl openrlhf; do
  if ! ls "$wheels/$set"/*.whl >/dev/null 2>&1; then
    echo "setup_gpu: MISSING wheel folder $wheels/$set"; fail=1; continue
  fi
  # one pip call per folder (the two share a few wheels of the same versions; --upgrade overwrites them)
  if ! out=$(timeout 300 "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$target" "$wheels/$set"/*.whl 2>&1); then
    echo "setup_gpu: INSTALL FAILED for $set:"; echo "$out" | tail -20; fail=1
  else
    echo "setup_gpu: installed $set wheels into $target"
  fi
done
# openrlhf's wheel also installs a top-level `tests` package, which would shadow the repository's own tests/
rm -rf "$target/tests"
export PYTHONPATH="$target${PYTHONPATH:+:$PYTHONPATH}"
export VLLM_ENABLE_V1_MULTIPROCESSING=${VLLM_ENABLE_V1_MULTIPROCESSING:-0}

checks=$(mktemp -d)
check() {  # name, python code: run in the background (the checks run side by side), reported in order below
  ( timeout 240 "$py" -c "$2" > "$checks/$1.out" 2>&1; echo $? > "$checks/$1.rc" ) &
  names+=("$1")
}
names=()
check torch "import torch; print(torch.__version__, torch.version.cuda, torch.cuda.device_count(), 'GPUs')"
check transformers "import transformers; print(transformers.__version__)"
check ray "import ray; print(ray.__version__)"
check vllm "import vllm; print(vllm.__version__)"
check flash_attn_pyparts "from flash_attn.bert_padding import unpad_input; from flash_attn.ops.triton.cross_entropy import cross_entropy_loss; from transformers.utils import is_flash_attn_2_available as a; print('pure-Python parts; transformers FA2 available:', a())"
check verl "import verl, tensordict, hydra, transfer_queue; from verl.trainer import main_ppo; from verl.trainer.ppo.v1 import trainer_base; import verl.workers.engine_workers, verl.experimental.agent_loop; print('verl', verl.__version__, 'tensordict', tensordict.__version__)"
check verl_vllm_rollout "import verl.workers.rollout.vllm_rollout.vllm_async_server as m; print('verl vLLM server module ok')"
check deepspeed "import deepspeed; print(deepspeed.__version__)"
check openrlhf "import openrlhf, importlib.metadata as md; from openrlhf.trainer.ray import create_vllm_engines; from openrlhf.trainer.ray.launcher import RayActorGroup; from openrlhf.trainer.ray.ppo_actor import PolicyModelActor; print('openrlhf', md.version('openrlhf'))"
wait
for n in "${names[@]}"; do
  rc=$(cat "$checks/$n.rc" 2>/dev/null || echo 1)
  if [ "$rc" = 0 ]; then
    echo "setup_gpu: ok   $n  $(tail -1 "$checks/$n.out")"
  else
    echo "setup_gpu: FAIL $n (exit $rc):"; grep -v "^WARNING" "$checks/$n.out" | tail -15 | sed 's/^/    /'; fail=1
  fi
done
rm -rf "$checks"
if command -v nvcc >/dev/null 2>&1 || [ -x "${CUDA_HOME:-/usr/local/cuda}/bin/nvcc" ]; then
  echo "setup_gpu: ok   nvcc (DeepSpeed can JIT-build FusedAdam for OpenRLHF)"
else
  echo "setup_gpu: note no nvcc: openrlhf_grpo.py will use DeepSpeed's torch AdamW (--torch-adam auto)"
fi
echo "export PYTHONPATH=$PYTHONPATH"
[ "$fail" = 0 ] && echo "setup_gpu: ALL OK" || echo "setup_gpu: SOME CHECKS FAILED (see above)"
exit $fail
