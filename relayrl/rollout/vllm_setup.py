"""What starting the `vllm` engine takes (rollout/vllm_engine.py): the version pin, the import, and the
EngineArgs the factory derives from its settings (relayrl/rollout/build.py, `VLLMEngine.options`).

    engine_options(EngineSettings(placement="colocated", max_seqs=32, dtype="bfloat16"))
        -> {max_seq_len?, gpu_memory_utilization: 0.35, dtype, max_num_seqs, seed: 0, enable_prefix_caching,
            trust_remote_code, keep_rng: True, enable_sleep_mode: True, **engine_args}

Pinned: vLLM 0.26 (the adapter uses in-process internals: `LLMEngine(multiprocess_mode=False)`,
`collective_rpc`, `reset_prefix_cache(reset_running_requests=True)`); another version raises a RuntimeError
naming both versions (`check_vllm_version`) unless EngineSettings.any_version (--rollout.vllm_any_version).

GPU memory: `gpu_share` is the one decision of vLLM's gpu_memory_utilization: VLLM_GPU_UTIL beside a trainer
on its GPU, VLLM_SEPARATE_GPU_UTIL for a separate engine actor, vLLM's own default (0.9) for a command that
only generates (generate, serve); EngineSettings.gpu_util (--rollout.vllm_gpu_util, serve: --vllm_gpu_util)
overrides each.
Beside a trainer (colocated or separate) the engine also gets seed 0, prefix caching, the model's
trust_remote_code and `keep_rng` (vLLM seeds the process's global RNGs when it starts: they are restored, so
the trainer's random stream does not depend on the engine), and either sleep mode (colocated:
dist.engine_sleep frees it during updates) or `tp` worker processes (separate: vLLM's "mp" executor).
"""

from __future__ import annotations

import contextlib
import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from relayrl.rollout.base import EngineSettings, Placement

SUPPORTED_VLLM = "0.26"
"""The vLLM release line this adapter is written and tested against (EngineSettings.any_version: any)."""

ENGINE_DEFAULTS: dict[str, Any] = dict(
    skip_tokenizer_init=True,
    generation_config="vllm",
    logprobs_mode="processed_logprobs",
    disable_log_stats=True,
    stream_interval=1,
)
"""vLLM `EngineArgs` this adapter sets unless the caller passes them (see the module doc)."""

VLLM_GPU_UTIL = 0.35
"""Share of the GPU's memory a colocated vLLM engine takes (weights + KV cache; vLLM's
gpu_memory_utilization): the rest stays for the trainer on the same GPU. --rollout.vllm_gpu_util overrides it
(e.g. 0.6 when the trainer is small, or with --dist.engine_sleep yes)."""

VLLM_SEPARATE_GPU_UTIL = 0.85
"""The same for a separate engine actor (dist.num_engines), whose GPUs hold no trainer; the rest is the
actor's own CUDA context and NCCL buffers (--rollout.vllm_gpu_util overrides it too)."""

_DEFAULT_SHARE: dict[str, float | None] = {
    "alone": None,
    "colocated": VLLM_GPU_UTIL,
    "separate": VLLM_SEPARATE_GPU_UTIL,
}


def gpu_share(placement: Placement, explicit: float = 0.0) -> float | None:
    """The one decision of vLLM's gpu_memory_utilization: `explicit` (EngineSettings.gpu_util, from
    --rollout.vllm_gpu_util / serve's --vllm_gpu_util) when > 0, else the placement's default (None: alone,
    vLLM's own default). A ValueError unless the share is in (0, 1)."""
    util = explicit or _DEFAULT_SHARE[placement]
    if util is not None and not 0 < util < 1:
        raise ValueError(f"vllm gpu_memory_utilization {util}: give a fraction of the GPU's memory in (0, 1)")
    return util


@contextlib.contextmanager
def keeping_global_rng() -> Iterator[None]:
    """Python, numpy, torch CPU and every CUDA RNG state restored after the block (vLLM seeds them all)."""
    py, npy = random.getstate(), np.random.get_state()
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):
        try:
            yield
        finally:
            random.setstate(py)
            np.random.set_state(npy)


def check_vllm_version(version: str) -> None:
    """Raise a RuntimeError unless `version` is of the SUPPORTED_VLLM line (e.g. 0.26.0, 0.26.1rc2)."""
    if version == SUPPORTED_VLLM or version.startswith(SUPPORTED_VLLM + "."):
        return
    raise RuntimeError(
        f'rollout engine "vllm" supports vLLM {SUPPORTED_VLLM}.x, but vllm {version} is installed: '
        f'pip install "vllm=={SUPPORTED_VLLM}.*", or set --rollout.vllm_any_version true (serve: '
        "--vllm_any_version true) to try this version anyway (the adapter relies on vLLM internals that change "
        "between releases), or use engine native"
    )


def import_vllm(any_version: bool = False) -> Any:
    """The vllm module (an ImportError saying how to install it; a RuntimeError for another version unless
    `any_version`)."""
    try:
        import vllm  # pyright: ignore[reportMissingImports] (optional package)
    except ImportError as exc:
        raise ImportError(
            'rollout engine "vllm" needs the vllm package (pip install "vllm==0.26.*", on a CUDA machine); '
            'or use engine "native" (built in) or "hf"'
        ) from exc
    if not any_version:
        check_vllm_version(vllm.__version__)
    return vllm


def folder_eos_ids(model_dir: str) -> list[int]:
    """EOS ids from a model folder: generation_config.json, else config.json; [] when neither names one."""
    for name in ("generation_config.json", "config.json"):
        path = Path(model_dir) / name
        if path.is_file():
            ids = json.loads(path.read_text()).get("eos_token_id")
            if ids is not None:
                return [int(i) for i in ([ids] if isinstance(ids, int) else ids)]
    return []


def engine_options(settings: EngineSettings) -> dict[str, Any]:
    """VLLMEngine's constructor keywords for the factory's `settings` (module doc); settings.engine_args (the
    user's EngineArgs) last, so they win."""
    s = settings
    args: dict[str, Any] = {} if s.max_seq_len is None else {"max_seq_len": s.max_seq_len}
    util = gpu_share(s.placement, s.gpu_util)
    if util is not None:
        args["gpu_memory_utilization"] = util
    if s.dtype:
        args["dtype"] = s.dtype
    if s.max_seqs is not None:
        args["max_num_seqs"] = s.max_seqs
    if (
        s.placement != "alone"
    ):  # beside a trainer: a reproducible start-up that leaves the trainer's RNG alone
        args.update(seed=0, enable_prefix_caching=True, trust_remote_code=s.trust_remote_code, keep_rng=True)
        if s.placement == "separate":
            args.update(tensor_parallel_size=s.tp, distributed_executor_backend="mp")
        else:
            args["enable_sleep_mode"] = True
    if s.any_version:
        args["any_version"] = True
    args.update(s.engine_args)  # the layout keys are refused by the config (VLLM_ARGS_FROM_CONFIG)
    return args
