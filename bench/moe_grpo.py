"""GRPO on a Qwen3-30B-A3B-shaped mixture-of-experts policy over 2 ranks without Ray (torchrun): a 2-rank
FSDP2 policy (every parameter sharded, the 3-D expert tensors included), a native engine with the MoE Triton
kernels colocated on each rank, routing replay off and on; step time per phase, peak memory per rank, engine
refresh, start-up, the train-inference mismatch and the route flips each way, the weight canary.

    torchrun --standalone --nproc_per_node=2 bench/moe_grpo.py                      # 2 GPUs, 16 layers
    torchrun --standalone --nproc_per_node=2 bench/moe_grpo.py --layers 8           # smaller
    torchrun --standalone --nproc_per_node=2 bench/moe_grpo.py --device cpu --shape tiny   # CPU smoke (gloo)

The machinery is bench/tp_grpo.py's (imported, not copied): every rank builds the product's `PolicyWorker`
(workers/policy.py) as `relayrl rl` does in ray mode (dist.policy_num_gpus_per_node = ranks, engine_tp 1: each
rank's engine holds a full bf16 replica refreshed from the FSDP shards by the worker's own `sync`), the model
built on the meta device and each rank initialising only its own shards. The shape is bench/moe.py's
(hidden 2048, 32 query / 4 KV heads of 128, 128 experts of width 768, top-8 renormalised, vocabulary 151936;
--layers of its 48), random weights; the router and the LM head re-drawn with std gain / sqrt(hidden)
(--router-gain, --head-gain, as bench/moe.py's mismatch phase: HF's 0.02 init leaves both near-uniform).

One step is the controller's (trainers/rl/loop.py): rollout on every rank's engine (the built-in add2 task's
prompts, --samples per prompt) -> trajectories concatenated across ranks in rank order (the Ray launcher's
merge) -> experience: the old-log-prob pass (PolicyWorker.logprobs, as `relayrl rl` runs it whenever the update
is not exactly on-policy; here always, so that the mismatch is measured as the product measures it:
algorithms.off_policy.logprob_mismatch), rewards, group-normalised advantages -> `update` -> `sync`. GRPO here
= group_norm + PPO-clip, no KL (no reference). Reward (--reward): parity (default: the share of generated
tokens with an even id, so every group has reward variance and the update moves the weights) or add2 (the
task's exact-match reward: always 0 for random weights, so every advantage is 0 and the optimizer moves
nothing).

Routing replay: the engine records routes in every step (rollout.routing_replay = true: the off steps need them
to count route flips); a step with replay "off" hides them from the trainer (its MoE passes route by
themselves, exactly as with routing_replay = false), one "on" replays them (the product's path). Steps: one
warm-up (off), then off and on alternately, --steps of each. Per step: generation_s, experience_s, update_s,
sync_s, refresh_s (timing/engine_refresh), step_s, gen tokens/s, peak_gib / reserved_gib per rank, the
mismatch/* metrics (mean |engine - trainer| log-prob of the sampled tokens, p99, max, share of sequences with
the ratio outside [0.5, 2]), route_flip_share (share of (token, MoE layer) whose expert set the trainer's
old-log-prob forward used differs from the engine's; 0 by construction with replay on) and
router_disagreement (replay on: the share the trainer's own router would have picked differently),
train/logprob_diff of the update. Once: build_s, init_refresh_s, startup_s (process start to the first step),
stale_before_sync (step 1: max |engine - trainer| weight after the update, > 0 when the weights moved), canary
(the same after the last sync: 0 expected), expert_sharding (each expert tensor's global and local shape and
placement, rank 0). Summary per mode (medians of the timed steps). Before building anything, the memory
estimate per rank (fp32 params + grads + AdamW = 16 bytes / parameter / rank; the engine's full bf16 replica
+ KV cache; a gathered layer and its fp32 gradient, the root unit, activations); --layers is lowered to what
fits when it does not. Written to $OUT/moe_grpo.json (bench/results/ without $OUT) after every step;
--time-limit (a watchdog) writes what was measured and exits 124; steps that would not finish in time are
skipped.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

_T0 = time.perf_counter()
sys.path.insert(0, str(Path(__file__).resolve().parent))
import argparse  # noqa: E402
import contextlib  # noqa: E402
import datetime  # noqa: E402
import os  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import tp_grpo as TG  # noqa: E402  (it pins this rank's GPU at import, before CUDA initialises)
from moe import SHAPES  # noqa: E402
from moe import config as moe_config  # noqa: E402

import relayrl.workers.model_ops as model_ops  # noqa: E402
from relayrl.algorithms.off_policy import logprob_mismatch  # noqa: E402
from relayrl.data.records import PromptSample  # noqa: E402
from relayrl.models.moe import install_moe, moe_pass  # noqa: E402
from relayrl.models.tiny import build_tiny_tokenizer  # noqa: E402
from relayrl.tasks.registry import get_task  # noqa: E402
from relayrl.trainers.rl.experience import step_advantages, trajectory_rewards  # noqa: E402
from relayrl.workers.base import Experience, collate  # noqa: E402
from relayrl.workers.policy import PolicySpec, PolicyWorker  # noqa: E402

GIB = 2**30
NAME = "moe_grpo.json"


# ---------------------------------------------------------------------------------------------- the model
def model_config(args: argparse.Namespace, layers: int, tokenizer: Any) -> Any:
    cfg = moe_config(args.shape, layers)
    cfg.pad_token_id, cfg.eos_token_id = tokenizer.pad_token_id, tokenizer.eos_token_id
    return cfg


def meta_model(args: argparse.Namespace, layers: int, tokenizer: Any) -> torch.nn.Module:
    from transformers import Qwen3MoeForCausalLM

    with torch.device("meta"):
        model = Qwen3MoeForCausalLM(model_config(args, layers, tokenizer))
    install_moe(model)  # as the product's loaders do (models/loading.py, models/empty.py)
    return model


def redraw(args: argparse.Namespace):
    """after_init for tp_grpo.install_meta_build: this rank's shard of every router and of the LM head
    ~ N(0, gain^2 / fan-in), as bench/moe.py's `redraw` does on a whole model."""

    @torch.no_grad()
    def run(model: Any, device: torch.device) -> None:
        dev = torch.device("cuda", torch.cuda.current_device()) if device.type == "cuda" else device
        gen = torch.Generator(device=dev).manual_seed(4321 + dist.get_rank())
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight") or name.endswith("lm_head.weight"):
                gain = args.router_gain if "gate" in name else args.head_gain
                local = p.to_local() if hasattr(p, "to_local") else p.data
                draw = torch.empty(local.shape, device=dev)
                local.copy_(draw.normal_(0.0, gain / p.shape[1] ** 0.5, generator=gen))

    return run


def budget(args: argparse.Namespace, layers: int, tokenizer: Any, world: int) -> dict[str, float]:
    """Memory estimate per rank in GiB (module doc), from the meta model's own parameter counts."""
    m: Any = meta_model(args, layers, tokenizer)
    total = sum(p.numel() for p in m.parameters())
    per_layer = sum(p.numel() for p in m.model.layers[0].parameters())
    experts = sum(p.numel() for n, p in m.named_parameters() if ".experts." in n)
    root = total - layers * per_layer  # embedding, LM head, final norm
    c = m.config
    slots = (
        -(-args.prompts // world) + -(-args.prompts // world // 8)
    ) * args.samples  # builders.engine_slots
    kv = 2 * layers * slots * c.num_key_value_heads * c.head_dim * (args.prompt_len + args.new_tokens) * 2
    states = 16 * total / world
    engine = 2 * total + kv
    # a gathered bf16 layer + the next (prefetch), its fp32 gradient before the reduce-scatter, the root unit
    # gathered in bf16 with its fp32 gradient; activations, CUDA graphs, kernels' workspaces
    transient = 2 * 2 * per_layer + 4 * per_layer + (2 + 4) * root + 4 * GIB
    return {
        "params_b": total / 1e9,
        "expert_params_b": experts / 1e9,
        "trainer_states_gib_per_rank": states / GIB,
        "engine_gib_per_rank": engine / GIB,
        "kv_cache_gib_per_rank": kv / GIB,
        "transient_gib": transient / GIB,
        "gpu_gib_per_gpu": (states + engine + transient) / GIB,
    }


def expert_sharding(model: Any) -> dict[str, Any]:
    """Global / local shape and placement of the first layer's expert tensors (FSDP2 DTensors when sharded)."""
    out = {}
    for name, p in model.named_parameters():
        if ".layers.0." in name and ".experts." in name:
            local = p.to_local() if hasattr(p, "to_local") else p
            out[name] = dict(global_shape=list(p.shape), local_shape=list(local.shape),
                             placement=str(getattr(p, "placements", "not sharded")))  # fmt: skip
    return out


# ---------------------------------------------------------------------------------------------- routes
class RouteProbe:
    """Stands in for model_ops.moe_pass: with `replay` False the trainer's MoE passes route by themselves
    (the recorded routes are hidden, as with routing_replay = false), True replays them; a no-grad pass (the
    old-log-prob pass) also counts the (token, layer) pairs whose expert set differs from the recorded one,
    and with replay on, those the trainer's own router would have picked differently."""

    def __init__(self) -> None:
        self.replay = False
        self.counts = torch.zeros(3, dtype=torch.float64)  # flips, router disagreements, (token, layer) pairs

    @contextlib.contextmanager
    def __call__(self, lengths: Any, *, routes: torch.Tensor | None = None, collect: bool = False):
        measure = routes is not None and not torch.is_grad_enabled()
        used = routes if self.replay else None
        with moe_pass(lengths, routes=used, collect=collect or (measure and self.replay)) as p:
            yield p
        if not measure or routes is None:
            return
        fed = routes[:, 0, 0] >= 0  # the last token of a sequence was never fed to the engine
        want = routes[fed].long().sort(-1).values.cpu()
        taken = torch.stack(p.taken, dim=1)[fed.to(p.taken[0].device)].sort(-1).values.cpu()
        self.counts[0] += float((taken != want).any(-1).sum())
        self.counts[2] += float(want.shape[0] * want.shape[1])
        if self.replay and p.logits:
            k = want.shape[-1]
            own = torch.stack([lg.topk(k, dim=-1).indices for lg in p.logits], dim=1)
            own = own[fed.to(own.device)].sort(-1).values.cpu()
            self.counts[1] += float((own != want).any(-1).sum())

    def take(self) -> dict[str, float | None]:
        c = self.counts.clone()
        dist.all_reduce(c)  # gloo: CPU tensors; NCCL needs them on the GPU
        self.counts.zero_()
        pairs = max(float(c[2]), 1.0)
        return {
            "route_flip_share": float(c[0]) / pairs,
            "router_disagreement": float(c[1]) / pairs if self.replay else None,
            "route_pairs": float(c[2]),
        }


# ---------------------------------------------------------------------------------------------- the step
def prompts(args: argparse.Namespace, tokenizer: Any, step: int) -> list[PromptSample]:
    rows = get_task("add2").make_rows("train", args.prompts, seed=100 + step)
    return [
        PromptSample(index=step * args.prompts + i, prompt=r["input"], label=r["label"],
                     prompt_ids=tokenizer.encode(r["input"], add_special_tokens=False))
        for i, r in enumerate(rows)
    ]  # fmt: skip


def reward(args: argparse.Namespace, tokenizer: Any, traj: Any) -> float:
    gen = [tok for tok, act in zip(traj.token_ids, traj.action_mask, strict=True) if act]
    if args.reward == "parity":
        return sum(tok % 2 == 0 for tok in gen) / max(1, len(gen))
    text = tokenizer.decode([t for t in gen if t < len(tokenizer)], skip_special_tokens=True)
    return get_task("add2").reward(text, traj.sample.label)


def gathered_rows(piece: torch.Tensor) -> torch.Tensor:
    """Every rank's rows in rank order (the "concat" merge of PolicyWorker.logprobs)."""
    parts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(parts, piece)
    return torch.cat(parts, 0)


def one_step(args, cfg, worker: PolicyWorker, probe: RouteProbe, step: int, mode: str, device) -> dict:
    probe.replay = mode == "on"
    TG.sync_all(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    trajs = TG.gathered(worker.rollout(prompts(args, worker.tokenizer, step), seed=step))
    t1 = time.perf_counter()
    for t in trajs:
        t.reward = reward(args, worker.tokenizer, t)
    batch = collate(trajs, int(worker.tokenizer.pad_token_id))
    old = gathered_rows(worker.logprobs(batch))  # the controller's make_experience (module doc)
    routes = probe.take()
    mm = logprob_mismatch(old, batch.rollout_logprobs, batch.action_mask)
    rewards, _ = trajectory_rewards(trajs, cfg, None)
    adv, _, _, _ = step_advantages(
        cfg, rewards=rewards, action_mask=batch.action_mask, old_logprobs=old, ref_logprobs=None,
        values=None, kl_coef=0.0,
    )  # fmt: skip
    exp = Experience(tokens=batch, old_logprobs=old, advantages=adv, rewards=rewards)
    t2 = time.perf_counter()
    metrics = worker.update(exp, 0.0)
    TG.sync_all(device)
    t3 = time.perf_counter()
    stale = max(TG.per_rank(worker.weights.max_abs_diff())) if step == 1 else None
    check_s = time.perf_counter() - t3  # left out of the step's times
    refresh = worker.sync(version=step)["timing/engine_refresh"]
    TG.sync_all(device)
    t4 = time.perf_counter() - check_s
    tokens = sum(sum(t.action_mask) for t in trajs)
    cuda = device.type == "cuda"
    out = {
        "step": step, "mode": mode, "step_s": t4 - t0, "generation_s": t1 - t0, "experience_s": t2 - t1,
        "update_s": t3 - t2, "sync_s": t4 - t3, "refresh_s": max(TG.per_rank(refresh)), "samples": len(trajs),
        "gen_tokens": tokens, "gen_tokens_per_s": tokens / (t1 - t0), "reward": float(rewards.mean()),
        "stale_before_sync": stale, **{f"mismatch/{k}": v for k, v in mm.items()}, **routes,
        "train_logprob_diff": metrics.get("train/logprob_diff"), "loss": metrics.get("train/loss"),
        "grad_norm": metrics.get("train/grad_norm"),
        "peak_gib": TG.per_rank(torch.cuda.max_memory_allocated(device) / GIB if cuda else 0.0),
        "reserved_gib": TG.per_rank(torch.cuda.max_memory_reserved(device) / GIB if cuda else 0.0),
    }  # fmt: skip
    if dist.get_rank() == 0:
        print(f"step {step} replay {mode}: {out['step_s']:.2f} s (gen {out['generation_s']:.2f}, exp "
              f"{out['experience_s']:.2f}, update {out['update_s']:.2f}, sync {out['sync_s']:.2f}), mismatch "
              f"{mm.get('logprob_absdiff_mean', 0):.4f} seq-out {mm.get('seq_ratio_out_frac', 0):.4f} flips "
              f"{routes['route_flip_share']:.4f}, peak {max(out['peak_gib']):.1f} GiB", flush=True)  # fmt: skip
    return out


# ---------------------------------------------------------------------------------------------- main
def choose_layers(args: argparse.Namespace, tokenizer: Any, device: torch.device, report: dict) -> int:
    """--layers, lowered to the most that the estimate fits on this GPU (0 if not even one does)."""
    world = dist.get_world_size()
    for layers in range(args.layers, 0, -1):
        est = budget(args, layers, tokenizer, world)
        why = TG.fits(args, est, device)
        if not why:
            report["budget"] = est
            if layers != args.layers:
                report["layers_lowered_from"] = args.layers
            return layers
        report.setdefault("does_not_fit", {})[layers] = why
    return 0


def summarise(report: dict) -> None:
    timed = [s for s in report["steps"] if s["step"] > 1] or report["steps"]
    for mode in ("off", "on"):
        rows = [s for s in timed if s["mode"] == mode]
        if not rows:
            continue
        keys = [k for k, v in rows[0].items() if isinstance(v, float) and k not in ("stale_before_sync",)]
        summ = {
            k: statistics.median(r[k] for r in rows if r[k] is not None)
            for k in keys
            if rows[0][k] is not None
        }
        summ["peak_gib"] = [max(r["peak_gib"][i] for r in rows) for i in range(len(rows[0]["peak_gib"]))]
        summ["steps"] = len(rows)
        report[f"replay_{mode}"] = summ
    off, on = report.get("replay_off", {}), report.get("replay_on", {})
    a, b = off.get("mismatch/seq_ratio_out_frac"), on.get("mismatch/seq_ratio_out_frac")
    if a is not None and b is not None:
        report["seq_out_of_range_reduction"] = a / b if b else None  # None: replay left none out of range


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-30b-a3b")
    ap.add_argument(
        "--layers", type=int, default=16, help="decoder layers (of 48); lowered if they do not fit"
    )
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--samples", type=int, default=4, help="samples per prompt (the GRPO group)")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument(
        "--prompt-len", type=int, default=8, help="add2 prompts' longest length (memory estimate)"
    )
    ap.add_argument("--steps", type=int, default=3, help="timed steps per replay mode (after one warm-up)")
    ap.add_argument("--reward", choices=("parity", "add2"), default="parity", help="see the module doc")
    ap.add_argument("--router-gain", type=float, default=2.0)
    ap.add_argument("--head-gain", type=float, default=8.0)
    ap.add_argument("--time-limit", type=float, default=225.0, help="seconds before partial results + exit")
    args = ap.parse_args()
    args.offload, args.folder = False, ""  # what tp_grpo's helpers read
    if args.device == "cuda":
        device = torch.device("cuda", 0)  # this rank's only visible GPU (tp_grpo pinned it)
        torch.cuda.set_device(device)
        # as the product's ranks join (distributed/group.join_group): NCCL for CUDA tensors, gloo for CPU ones
        dist.init_process_group("cpu:gloo,cuda:nccl", timeout=datetime.timedelta(seconds=300))
    else:
        device = torch.device("cpu")
        torch.set_num_threads(1)
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
    report: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "gpus": dist.get_world_size(), "torch": torch.__version__, "args": vars(args),
        "dims": SHAPES[args.shape], "steps": [],
    }  # fmt: skip
    TG.watchdog(args.time_limit - (time.perf_counter() - _T0), report, NAME)  # from the process start
    tokenizer = build_tiny_tokenizer()
    layers = choose_layers(args, tokenizer, device, report)
    report["layers"] = layers
    if not layers:
        report["status"] = "does-not-fit"
        TG.write(report, NAME)
        raise SystemExit(f"moe_grpo: no layer count fits: {report['does_not_fit']}")
    args.layers = layers
    probe = RouteProbe()
    model_ops.moe_pass = probe  # the trainer's forwards route through the probe (RouteProbe)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        tokenizer.save_pretrained(folder)
        model_config(args, layers, tokenizer).save_pretrained(folder)
        TG.install_meta_build(
            args, tokenizer, device, lambda: meta_model(args, layers, tokenizer), redraw(args)
        )
        cfg = TG.build_cfg(args, 1, folder, device, routing_replay=True)
        spec = PolicySpec(model=cfg.model, optim=cfg.optim, algo=cfg.algo, rollout=cfg.rollout, eval=cfg.eval,
                          total_steps=1 + 2 * args.steps, dist=cfg.dist, device=device.type, seed=0)  # fmt: skip
        t0 = time.perf_counter()
        worker = PolicyWorker(spec)
        TG.sync_all(device)
        report["build_s"] = time.perf_counter() - t0
        runner = getattr(worker.engine, "runner", None)
        report["engine"] = dict(weights=worker.weights.kind, fused_kernels=bool(getattr(runner, "kernels", False)),
                                moe_kernel_layers=sum(bool(getattr(f, "kernels", False)) for f in getattr(runner, "mlps", [])))  # fmt: skip
        report["expert_sharding"] = expert_sharding(worker.model)
        t0 = time.perf_counter()
        worker.sync(version=0)
        TG.sync_all(device)
        report["init_refresh_s"] = time.perf_counter() - t0
        report["startup_s"] = time.perf_counter() - _T0
        report["after_build_gib"] = TG.per_rank(
            torch.cuda.memory_allocated(device) / GIB if device.type == "cuda" else 0
        )
        TG.write(report, NAME)
        modes = ["off"] + ["on", "off"] * args.steps
        for step, mode in enumerate(modes, start=1):
            left = args.time_limit - (time.perf_counter() - _T0)
            last = report["steps"][-1]["step_s"] if report["steps"] else 0.0
            if left < 1.5 * last + 20:  # the canary and the write still need time
                report["stopped_early"] = f"{left:.0f} s left before step {step}"
                break
            report["steps"].append(one_step(args, cfg, worker, probe, step, mode, device))
            summarise(report)
            TG.write(report, NAME)
        report["canary"] = max(TG.per_rank(worker.weight_canary()))
        report["status"] = "ok"
        report["total_s"] = time.perf_counter() - _T0
        TG.write(report, NAME)
        if dist.get_rank() == 0:
            print(
                {k: report.get(k) for k in ("layers", "startup_s", "canary", "replay_off", "replay_on")},
                flush=True,
            )
        worker.close()
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)  # the watchdog's timer thread and engine threads must not keep the process alive


if __name__ == "__main__":
    main()
