"""GRPO with tensor-parallel native engines colocated with an FSDP2 policy: step time, generation, update and
engine refresh time, peak memory per GPU. One process per GPU, no Ray (torchrun), the product's own worker:

    torchrun --standalone --nproc_per_node=4 bench/tp_grpo.py --shape qwen2.5-32b --layers 16 --tp 4
    torchrun --standalone --nproc_per_node=4 bench/tp_grpo.py --shape qwen2.5-7b --tp 2 4
    torchrun --standalone --nproc_per_node=2 bench/tp_grpo.py --shape tiny --device cpu --tp 2   # smoke test

Every rank builds the real `PolicyWorker` (workers/policy.py) with dist.engine_tp = TP, exactly as `relayrl
rl` does in ray mode (ranks of one GPU each: CUDA_VISIBLE_DEVICES is set to the local rank, as Ray does), with
one change: the model is not loaded from a folder (the folder of a 32B model is 64 GB of disk), but built on
the meta device and, once FSDP2 has sharded it, each rank initialises only its own shards (N(0, 0.02), norms
1, biases 0). With --folder (an HF folder of the shape, e.g. `bench/sharded_load.py --shape qwen2.5-32b
--modes new --folder F` writes one and times its load) there is no change at all: the worker loads it by
shards as `relayrl rl` does (distributed/sharded_load.py: each rank reads only its rows, so 4 ranks never
need 4 x 131 GB of host memory as whole fp32 copies did). The engine's TP shard is then refreshed from
those shards by the worker's own `sync` (one parameter all-gathered at a time, distributed/weights/
tensor_parallel.py), so no rank ever holds the full model. The step is the controller's sync step (trainers/rl/
loop.py): rollout (the block leaders generate their block's share, the others follow) -> rewards ->
group-normalised advantages -> `update` -> `sync`, with each trajectory concatenated across ranks in rank
order as the Ray launcher's merge does. Reward: the fraction of generated tokens with an even id (random
weights never stop at EOS, so every sample has --new-tokens tokens and every group has reward variance).
GRPO here = group_norm advantages + PPO-clip loss, no KL (no reference model), exactly on-policy (one epoch,
one mini-batch: no old-log-prob pass).

Before building anything the script prints the memory budget per GPU (trainer: fp32 params + grads + AdamW =
16 bytes / parameter / rank; engine: bf16 TP shard + replicated embedding / LM head + KV cache) and, with
--offload, the host memory FSDP2's CPU offload needs, and refuses a configuration that cannot fit (JSON with
"status": "does-not-fit" and the numbers), instead of running out of memory mid-run.

Per TP size, JSON rows: build_s (worker construction: sharding, engine start-up, CUDA graphs), init_refresh_s,
and per timed step (the first step is a warm-up): step_s, generation_s, experience_s, update_s, sync_s,
refresh_s (the worker's timing/engine_refresh), gen_tokens_per_s, peak_gib per rank (max allocated over the
step), reserved_gib per rank, canary (max |engine - trainer| weight after the last step: 0 expected). Written
to $OUT/tp_grpo.json (bench/results/ without $OUT) after every step, so a run cut short leaves its rows.
"""

from __future__ import annotations

import os
import sys

if "--device" not in sys.argv or sys.argv[sys.argv.index("--device") + 1] == "cuda":  # one GPU per rank
    _local = int(os.environ.get("LOCAL_RANK", "0"))
    _visible = [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    os.environ["CUDA_VISIBLE_DEVICES"] = _visible[_local] if _visible else str(_local)

import argparse
import datetime
import gc
import json
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import relayrl.workers.policy as policy_mod
import relayrl.workers.trained as trained_mod
from relayrl.agents.base import Trajectory
from relayrl.config.components import ModelConfig, OptimConfig
from relayrl.config.dist import DistConfig
from relayrl.config.rl import AlgoConfig, RLConfig, RLTrainConfig, RolloutConfig
from relayrl.data.records import PromptSample
from relayrl.models.loading import finish_model
from relayrl.models.tiny import build_tiny_tokenizer
from relayrl.trainers.rl.experience import step_advantages, trajectory_rewards
from relayrl.trainers.rl.validate import validate_rl
from relayrl.workers.base import Experience, collate
from relayrl.workers.policy import PolicySpec, PolicyWorker

SHAPES: dict[str, dict[str, int]] = {
    "qwen2.5-32b": dict(hidden_size=5120, num_hidden_layers=64, num_attention_heads=40, num_key_value_heads=8,
                        intermediate_size=27648, vocab_size=152064),
    "qwen2.5-7b": dict(hidden_size=3584, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                       intermediate_size=18944, vocab_size=152064),
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4,
                 intermediate_size=128, vocab_size=512),
}  # fmt: skip
GIB = 2**30
SHARD_IF_GROUPED = trained_mod.shard_if_grouped
"""The worker's own sharding step (install_meta_build wraps it)."""


def shape_of(args: argparse.Namespace) -> dict[str, int]:
    s = dict(SHAPES[args.shape])
    if args.layers:
        s["num_hidden_layers"] = args.layers
    return s


def param_counts(s: dict[str, int]) -> dict[str, int]:
    """Parameters of a Qwen2 of shape `s` (q/k/v biases, untied LM head): per layer, embedding + head, total."""
    h, i, heads, kv = (
        s["hidden_size"],
        s["intermediate_size"],
        s["num_attention_heads"],
        s["num_key_value_heads"],
    )
    d = h // heads
    attn = h * h + h + 2 * (h * kv * d + kv * d) + h * h
    layer = attn + 3 * h * i + 2 * h
    vocab = 2 * s["vocab_size"] * h
    return {"layer": layer, "vocab": vocab, "total": s["num_hidden_layers"] * layer + vocab + h}


def budget(args: argparse.Namespace, tp: int, world: int) -> dict[str, float]:
    """Memory estimate in GiB (module doc): per GPU and, with --offload, host memory of all local ranks."""
    s, n = shape_of(args), param_counts(shape_of(args))
    layers, d = s["num_hidden_layers"], s["hidden_size"] // s["num_attention_heads"]
    states = 16 * n["total"] / world  # fp32 params + fp32 grads + AdamW m, v: sharded over the ranks
    slots = args.prompts * args.samples
    kv = 2 * layers * slots * (s["num_key_value_heads"] // tp) * (args.prompt_len + args.new_tokens) * d * 2
    engine = 2 * n["vocab"] + 2 * layers * n["layer"] / tp + kv
    # transients: a gathered bf16 layer (and the next, prefetched), the root unit (embedding + head) gathered
    # in bf16 with its fp32 gradient before the reduce-scatter, and the chunked LM-head log-probs
    transient = 2 * 2 * n["layer"] + (2 + 4) * n["vocab"] + 2 * GIB
    gpu = (0 if args.offload else states) + engine + transient
    return {
        "params_b": n["total"] / 1e9,
        "trainer_states_gib_per_rank": states / GIB,
        "engine_gib_per_gpu": engine / GIB,
        "kv_cache_gib_per_gpu": kv / GIB,
        "transient_gib": transient / GIB,
        "gpu_gib_per_gpu": gpu / GIB,
        "host_gib_all_ranks": (states * world / GIB) if args.offload else 0.0,
    }


def fits(args: argparse.Namespace, est: dict[str, float], device: torch.device) -> str:
    """'' when the estimate fits this machine, else why not."""
    if device.type != "cuda":
        return ""
    total = torch.cuda.get_device_properties(device).total_memory / GIB
    if est["gpu_gib_per_gpu"] > 0.97 * total:
        return f"needs ~{est['gpu_gib_per_gpu']:.0f} GiB per GPU, the GPU has {total:.0f} GiB"
    if args.offload:
        avail = _mem_available_gib()
        if est["host_gib_all_ranks"] > 0.85 * avail:
            return (
                f"CPU offload needs ~{est['host_gib_all_ranks']:.0f} GiB of pinned host memory for the fp32 "
                f"params, grads and AdamW states, {avail:.0f} GiB is available"
            )
    return ""


def _mem_available_gib() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024 / GIB
    return float("inf")


def build_cfg(args: argparse.Namespace, tp: int, folder: Path, device: torch.device, **rollout: Any) -> Any:
    """The resolved RL config of the run (validate_rl, as `relayrl rl` resolves it); `rollout`: more
    RolloutConfig fields (bench/moe_grpo.py: routing_replay)."""
    rows_per_rank = -(-args.prompts * args.samples // dist.get_world_size())
    max_len = args.prompt_len + args.new_tokens
    cfg = RLConfig(
        model=ModelConfig(name_or_path=str(folder), gradient_checkpointing=True),
        optim=OptimConfig(lr=1e-6, scheduler="constant", warmup_steps=0),
        train=RLTrainConfig(max_steps=args.steps, seed=0, device=device.type),
        rollout=RolloutConfig(
            prompts_per_step=args.prompts,
            n_samples=args.samples,
            max_new_tokens=args.new_tokens,
            max_len=max_len,
            temperature=1.0,
            **rollout,
        ),
        # one micro-batch per rank and optimizer step: no unsharded gradient accumulates across micro-batches
        algo=AlgoConfig(micro_batch_tokens=rows_per_rank * max_len),
        dist=DistConfig(
            mode="ray", policy_num_gpus_per_node=dist.get_world_size(), engine_tp=tp, offload=args.offload
        ),
    )
    return validate_rl(cfg)


def qwen2_config(args: argparse.Namespace, tokenizer: Any) -> Any:
    from transformers import Qwen2Config

    return Qwen2Config(
        **shape_of(args),
        max_position_embeddings=max(4096, args.prompt_len + args.new_tokens),
        tie_word_embeddings=False,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
    )


def install_meta_build(
    args: argparse.Namespace,
    tokenizer: Any,
    device: torch.device,
    meta_model: Callable[[], torch.nn.Module] | None = None,
    after_init: Callable[[Any, torch.device], None] | None = None,
) -> None:
    """The worker builds the policy on the meta device; once FSDP2 has sharded it, each rank materialises and
    initialises only its shards (module doc). `meta_model` builds another model than this script's Qwen2
    (called under the meta device; bench/moe_grpo.py: a Qwen3-MoE), `after_init(model, device)` re-draws
    some of the shards after `init_shards`."""
    from transformers import Qwen2ForCausalLM

    def build_trainable(
        model: ModelConfig, _device: torch.device, *, sharded: bool = False
    ) -> tuple[torch.nn.Module, Any]:
        """workers/builders.build_trainable without the weights: fp32, sdpa, gradient checkpointing as the
        config says (models/loading.finish_model). `sharded` (the product's sharded loading) is ignored: the
        shards are initialised randomly below, there is no folder to read."""
        with torch.device("meta"):
            meta = meta_model() if meta_model is not None else Qwen2ForCausalLM(qwen2_config(args, tokenizer))
        return finish_model(meta, model, task_type="CAUSAL_LM"), tokenizer

    shard = SHARD_IF_GROUPED

    def shard_then_init(model: Any, d: DistConfig | None, dev: torch.device, precision: str) -> bool:
        grouped = shard(model, d, dev, precision)
        model.to_empty(device=torch.device("cpu") if args.offload else dev)
        init_shards(model, dev)
        if after_init is not None:
            after_init(model, dev)
        return grouped

    policy_mod.build_trainable = build_trainable
    trained_mod.shard_if_grouped = shard_then_init


@torch.no_grad()
def init_shards(model: Any, device: torch.device) -> None:
    """N(0, 0.02) on this rank's shard of every matrix, 1 for norm weights, 0 for biases; the rotary table
    rebuilt on the compute device (to_empty left it uninitialised)."""
    if device.type == "cuda" and device.index is None:  # the worker's "cuda": this rank's (only) GPU
        device = torch.device("cuda", torch.cuda.current_device())
    gen = torch.Generator(device=device).manual_seed(1234 + dist.get_rank())  # on the GPU when there is one
    for name, p in model.named_parameters():
        local = p.to_local() if hasattr(p, "to_local") else p.data
        if name.endswith("norm.weight"):
            local.fill_(1.0)
        elif name.endswith(".bias"):
            local.zero_()
        elif local.device == device:
            local.normal_(0.0, 0.02, generator=gen)
        else:  # a CPU-offloaded shard: drawn on the GPU, copied over (one parameter's shard at a time)
            local.copy_(torch.empty(local.shape, device=device).normal_(0.0, 0.02, generator=gen))
    body = model.model
    with torch.device(device):
        body.rotary_emb = type(body.rotary_emb)(config=model.config)


def prompts(args: argparse.Namespace, tokenizer: Any, step: int) -> list[PromptSample]:
    g = torch.Generator().manual_seed(100 + step)
    low, high = 4, len(tokenizer)  # the tokenizer's own characters (the model's vocabulary is larger)
    out = []
    for i in range(args.prompts):
        ids = torch.randint(low, high, (args.prompt_len,), generator=g).tolist()
        out.append(PromptSample(index=step * args.prompts + i, prompt="", prompt_ids=ids))
    return out


def gathered(trajs: list[Trajectory]) -> list[Trajectory]:
    """Every rank's trajectories concatenated in rank order (the Ray launcher's "concat" merge)."""
    parts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(parts, trajs)
    return [t for p in parts for t in p]


def experience(cfg: Any, trajs: list[Trajectory], pad_id: int) -> tuple[Experience, float]:
    """The controller's make_experience for this run (rewards, group-normalised advantages); mean reward."""
    for t in trajs:
        gen = [tok for tok, act in zip(t.token_ids, t.action_mask, strict=True) if act]
        t.reward = sum(tok % 2 == 0 for tok in gen) / max(1, len(gen))
    batch = collate(trajs, pad_id)
    rewards, _ = trajectory_rewards(trajs, cfg, None)
    adv, _, _, _ = step_advantages(
        cfg, rewards=rewards, action_mask=batch.action_mask, old_logprobs=batch.rollout_logprobs,
        ref_logprobs=None, values=None, kl_coef=0.0,
    )  # fmt: skip
    return Experience(tokens=batch, advantages=adv, rewards=rewards), float(rewards.mean())


def per_rank(value: float) -> list[float]:
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return [float(v) for v in out]


def sync_all(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    dist.barrier()


def run_tp(args: argparse.Namespace, tp: int, device: torch.device, report: dict) -> dict:
    """One TP size: build the worker, then --steps GRPO steps (the first a warm-up)."""
    world = dist.get_world_size()
    row: dict[str, Any] = {"tp": tp, "engines": world // tp, "budget": budget(args, tp, world), "steps": []}
    report["rows"].append(row)
    why = fits(args, row["budget"], device)
    if why:
        row["status"] = f"does-not-fit: {why}"
        return row
    tokenizer = build_tiny_tokenizer()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(args.folder or tmp)
        if not args.folder:  # no weights on disk: random shards (module doc)
            tokenizer.save_pretrained(folder)
            qwen2_config(args, tokenizer).save_pretrained(folder)
            install_meta_build(args, tokenizer, device)
        cfg = build_cfg(args, tp, folder, device)
        spec = PolicySpec(model=cfg.model, optim=cfg.optim, algo=cfg.algo, rollout=cfg.rollout, eval=cfg.eval,
                          total_steps=args.steps, dist=cfg.dist, device=device.type, seed=0)  # fmt: skip
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        t0 = time.perf_counter()
        worker = PolicyWorker(spec)
        sync_all(device)
        row["build_s"] = time.perf_counter() - t0
        row["engine_weights"] = worker.weights.kind
        row["fused_kernels"] = bool(getattr(getattr(worker.engine, "runner", None), "kernels", False))
        row["fused_layers"] = int(getattr(getattr(worker.engine, "runner", None), "fused_layers", 0))
        t0 = time.perf_counter()
        worker.sync(version=0)  # the engine's shard from the freshly initialised FSDP shards
        sync_all(device)
        row["init_refresh_s"] = time.perf_counter() - t0
        row["after_build_gib"] = per_rank(
            torch.cuda.memory_allocated(device) / GIB if device.type == "cuda" else 0
        )
        pad_id = int(tokenizer.pad_token_id)
        for step in range(1, args.steps + 1):
            row["steps"].append(one_step(args, cfg, worker, step, pad_id, device))
            write(report)
        row["canary"] = max(per_rank(worker.weight_canary()))
        timed = row["steps"][1:] or row["steps"]
        for key in ("step_s", "generation_s", "update_s", "sync_s", "refresh_s", "gen_tokens_per_s"):
            row[key] = statistics.median(s[key] for s in timed)
        row["peak_gib"] = [max(s["peak_gib"][r] for s in row["steps"]) for r in range(world)]
        row["status"] = "ok"
        worker.close()
        del worker
    gc.collect()  # the worker's FSDP modules and optimizer hold reference cycles
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def one_step(args: argparse.Namespace, cfg: Any, worker: PolicyWorker, step: int, pad_id: int,
             device: torch.device) -> dict[str, Any]:  # fmt: skip
    sync_all(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    trajs = gathered(worker.rollout(prompts(args, worker.tokenizer, step), seed=step))
    t1 = time.perf_counter()
    exp, reward = experience(cfg, trajs, pad_id)
    t2 = time.perf_counter()
    metrics = worker.update(exp, 0.0)
    sync_all(device)
    t3 = time.perf_counter()
    # the warm-up step checks that the update moved the trained weights away from the engine's (the
    # optimizer steps the parameters FSDP computes with); the sync below must bring the canary back to 0
    stale = max(per_rank(worker.weights.max_abs_diff())) if step == 1 else None
    check_s = time.perf_counter() - t3  # left out of the step's times
    refresh = worker.sync(version=step)["timing/engine_refresh"]
    sync_all(device)
    t4 = time.perf_counter() - check_s
    tokens = sum(sum(t.action_mask) for t in trajs)
    peak = torch.cuda.max_memory_allocated(device) / GIB if device.type == "cuda" else 0.0
    reserved = torch.cuda.max_memory_reserved(device) / GIB if device.type == "cuda" else 0.0
    out = {
        "step": step,
        "step_s": t4 - t0,
        "generation_s": t1 - t0,
        "experience_s": t2 - t1,
        "update_s": t3 - t2,
        "sync_s": t4 - t3,
        "refresh_s": max(per_rank(refresh)),
        "samples": len(trajs),
        "gen_tokens": tokens,
        "gen_tokens_per_s": tokens / (t1 - t0),
        "reward": reward,
        "stale_before_sync": stale,
        "loss": metrics.get("train/loss"),
        "grad_norm": metrics.get("train/grad_norm"),
        "peak_gib": per_rank(peak),
        "reserved_gib": per_rank(reserved),
    }
    if dist.get_rank() == 0:
        print(f"tp {cfg.dist.engine_tp} step {step}: "
              f"{out['step_s']:.2f} s (gen {out['generation_s']:.2f}, update {out['update_s']:.2f}, "
              f"sync {out['sync_s']:.2f}), peak {max(out['peak_gib']):.1f} GiB", flush=True)  # fmt: skip
    return out


def write(report: dict, name: str = "tp_grpo.json") -> None:
    """`report` as $OUT/`name` (bench/results/ without $OUT), from rank 0."""
    if dist.get_rank() != 0:
        return
    folder = Path(os.environ.get("OUT") or Path(__file__).parent / "results")
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).write_text(json.dumps(report, indent=2))


def watchdog(seconds: float, report: dict, name: str = "tp_grpo.json") -> None:
    """Past `seconds`, write what was measured and end the process (exit 124): a stuck collective or a
    too-slow configuration never eats the caller's whole time limit."""

    def fire() -> None:
        report["timed_out_after_s"] = seconds
        try:  # the main thread may be changing the report right now
            write(report, name)
        except RuntimeError:
            write(json.loads(json.dumps(report, default=str)), name)
        print(
            f"{name.removesuffix('.json')}: time limit {seconds:.0f} s reached; partial results written",
            flush=True,
        )
        os._exit(124)

    timer = threading.Timer(seconds, fire)
    timer.daemon = True
    timer.start()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen2.5-32b")
    ap.add_argument("--layers", type=int, default=0, help="decoder layers (0: the shape's own)")
    ap.add_argument("--tp", type=int, nargs="+", default=[4], help="engine TP sizes, one run each")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--offload", action="store_true", help="FSDP2 CPU offload (dist.offload)")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--samples", type=int, default=8, help="samples per prompt (the GRPO group)")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument(
        "--steps", type=int, default=3, help="GRPO steps per TP size (the first one is a warm-up)"
    )
    ap.add_argument("--time-limit", type=float, default=480.0, help="seconds before partial results + exit")
    ap.add_argument(
        "--folder",
        default="",
        help="an HF folder of --shape (e.g. written by bench/sharded_load.py): the worker loads it as "
        "`relayrl rl` does (sharded loading: each rank reads its own rows) instead of random shards",
    )
    args = ap.parse_args()
    if args.device == "cuda":
        device = torch.device("cuda", 0)  # this rank's only visible GPU
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device, timeout=datetime.timedelta(seconds=300))
        if args.offload:  # the optimizer step runs on the CPU: the host's cores shared by the local ranks
            torch.set_num_threads(
                max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
            )
    else:
        device = torch.device("cpu")
        torch.set_num_threads(1)
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
    report: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "gpus": dist.get_world_size(),
        "torch": torch.__version__,
        "args": vars(args),
        "shape": shape_of(args),
        "rows": [],
    }
    watchdog(args.time_limit, report)
    for tp in args.tp:
        row = run_tp(args, tp, device, report)
        write(report)
        if dist.get_rank() == 0:
            print(json.dumps({k: v for k, v in row.items() if k != "steps"}), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
