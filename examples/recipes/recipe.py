"""A GPU recipe that learns from nothing downloadable: SFT, then GRPO / PPO / REINFORCE++ from the same checkpoint.

    python examples/recipes/recipe.py all --scale tiny --out OUT --work WORK      # every phase, one process
    python examples/recipes/recipe.py prepare --scale full --work WORK            # model + tokenizer + data
    python examples/recipes/recipe.py sft --scale full --work WORK --out OUT      # SFT, then the more-SFT control
    python examples/recipes/recipe.py rl --algo grpo --scale full --work WORK --out OUT
    python examples/recipes/plot.py OUT                                           # curves.png + results.{md,json}

(run_gpu.sh runs these on a 4-GPU host: SFT and its control on GPU 0, one RL algorithm on each of GPUs 1-3.)

Phases, all through relayrl's Python API as a user would call it:
  prepare  a Qwen2-shaped model with random weights and the character-level tokenizer
           (relayrl.models.tiny at the scale's shape; ~100M parameters at --scale full), and three disjoint
           sets of problems (recipe_task.py): a FIXED, SMALL set of worked demonstrations for SFT, fresh RL
           prompts, held-out prompts.
  sft      relayrl's SFT recipe (relayrl.trainers.sft.sft_recipe, run by relayrl.trainers.recipe.run_recipe) on
           the demonstrations for `sft_seconds` of wall time; the model is then exported to WORK/sft/final
           (the checkpoint every RL run starts from), and the same run CONTINUES for `rl_seconds` as the
           more-SFT control, evaluated every `eval_seconds` (OUT/sft_control/curve.jsonl).
  rl       relayrl.trainers.rl.loop.RLTrainer from WORK/sft/final with the task's reward (recipe_task.score,
           through reward_func), for `rl_seconds` of wall time, evaluated every `eval_seconds`
           (OUT/<algo>/curve.jsonl). The t=0 point of every curve is the SFT model.

Every evaluation is the same function (`heldout_em`): greedy decoding of every held-out prompt with relayrl's
native engine over the model being trained, recipe_task.MAX_NEW_TOKENS new tokens, recipe_task.exact_match.
Curve lines: {"t": wall seconds since the run's start (evaluation included), "step": k, "heldout_em": x,
"eval_s": seconds of evaluation so far}.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import recipe_task as task
from plot import write_results

from relayrl.agents.executors import decode_response
from relayrl.config.components import (
    CkptConfig,
    DataConfig,
    LoggerConfig,
    ModelConfig,
    OptimConfig,
    TrainConfig,
)
from relayrl.config.recipes import SFTConfig
from relayrl.config.rl import AlgoConfig, CriticConfig, RewardConfig, RLConfig, RLTrainConfig, RolloutConfig
from relayrl.data.packing import make_collate
from relayrl.distributed.launch.local import LocalRole
from relayrl.models.tiny import TinyModelSpec, build_tiny_model, build_tiny_tokenizer
from relayrl.rollout.base import EngineSettings, GenerationRequest, SamplingParams, generate_all
from relayrl.rollout.build import build_engine
from relayrl.trainers.recipe import run_recipe
from relayrl.trainers.rl.loop import RLTrainer
from relayrl.trainers.sft import sft_recipe
from relayrl.workers.trained import ModelWorker

ALGOS = ("grpo", "ppo", "reinforce++")
"""The RL runs, by relayrl preset name (docs/rl.md "Choosing the algorithm")."""


@dataclass(kw_only=True, frozen=True)
class Scale:
    """Model shape, data sizes and time budgets of one scale of the recipe."""

    model: TinyModelSpec
    sft_rows: int
    """Demonstrations SFT sees (a fixed set, repeated over epochs): the limit RL's fresh prompts lift."""
    rl_rows: int
    """Fresh RL prompts (more than a run draws: every RL prompt is new)."""
    heldout_rows: int
    sft_seconds: float
    """Wall time of SFT before its checkpoint is exported."""
    rl_seconds: float
    """Wall time of each RL run, and of the more-SFT control after the checkpoint."""
    eval_seconds: float
    """Held-out evaluation every this many seconds of a run."""
    sft_lr: float
    sft_batch: int
    rl: dict[str, Any]
    """recipe_task.RL_SETTINGS, with this scale's overrides."""
    critic_lr: float
    new_tokens: int = task.MAX_NEW_TOKENS
    digits: tuple[int, int] = (task.MIN_DIGITS, task.MAX_DIGITS)
    """Operand lengths (the task's; the CPU check's are shorter, to fit 2 CPU cores)."""
    """New tokens per completion, in RL and in evaluation (the tiny scale cuts it: nothing is learned there)."""


SCALES: dict[str, Scale] = {
    # the CPU test: the same code path in seconds (nothing is expected to be learned)
    "tiny": Scale(
        model=TinyModelSpec(hidden=64, layers=2, heads=4, kv_heads=2, max_positions=160),
        sft_rows=64,
        rl_rows=256,
        heldout_rows=4,
        sft_seconds=2.0,
        rl_seconds=2.0,
        eval_seconds=1.0,
        sft_lr=1e-3,
        sft_batch=16,
        rl={**task.RL_SETTINGS, "group_size": 4, "prompts_per_step": 4, "learning_rate": 1e-4},
        critic_lr=1e-4,
        new_tokens=12,
    ),
    # the CPU check that RL lifts held-out accuracy over SFT (a ~1M model, minutes on 2 cores)
    "medium": Scale(
        model=TinyModelSpec(hidden=96, layers=3, heads=4, kv_heads=2, max_positions=160),
        sft_rows=400,
        rl_rows=20000,
        heldout_rows=100,
        sft_seconds=300.0,
        rl_seconds=300.0,
        eval_seconds=60.0,
        sft_lr=2e-3,
        sft_batch=32,
        rl={**task.RL_SETTINGS, "prompts_per_step": 16, "learning_rate": 2e-4},
        critic_lr=1e-3,
        new_tokens=40,
        digits=(2, 3),
    ),
    # one H100 / H200 per run: a ~100M Qwen2 shape (12 layers, hidden 768, MLP 3072, 12 heads, 4 KV heads)
    "full": Scale(
        model=TinyModelSpec(
            hidden=768, layers=12, heads=12, kv_heads=4, intermediate=3072, max_positions=160
        ),
        sft_rows=2000,
        rl_rows=40000,
        heldout_rows=500,
        sft_seconds=125.0,
        rl_seconds=260.0,
        eval_seconds=30.0,
        sft_lr=3e-4,
        sft_batch=128,
        rl=dict(task.RL_SETTINGS),
        critic_lr=1e-4,
    ),
}


def scale_of(args: argparse.Namespace) -> Scale:
    """The named scale with the time budgets the command line / environment override."""
    s = SCALES[args.scale]
    over: dict[str, Any] = {
        k: float(v) for k, v in (("sft_seconds", args.sft_seconds), ("rl_seconds", args.rl_seconds)) if v
    }
    if args.sft_rows:
        over["sft_rows"] = args.sft_rows
    return dataclasses.replace(s, **over) if over else s


# ---------------------------------------------------------------------------------------------- prepare
def prepare(scale: Scale, work: Path, seed: int) -> None:
    """WORK/base (model + tokenizer) and WORK/data/{sft,train_prompts,heldout}.jsonl (disjoint problems)."""
    tok = build_tiny_tokenizer()
    model = build_tiny_model(tok, dataclasses.replace(scale.model, seed=seed))
    model.save_pretrained(work / "base")
    tok.save_pretrained(work / "base")
    params = sum(p.numel() for p in model.parameters())
    heldout = task.make_rows(scale.heldout_rows, seed + 1, digits=scale.digits)
    sft = task.make_rows(scale.sft_rows, seed + 2, {r["prompt"] for r in heldout}, scale.digits)
    rl = task.make_rows(scale.rl_rows, seed + 3, {r["prompt"] for r in heldout + sft}, scale.digits)
    data = work / "data"
    data.mkdir(parents=True, exist_ok=True)
    for name, rows, keys in (
        ("sft", sft, ("prompt", "completion", "answer")),
        ("train_prompts", rl, ("prompt", "answer")),
        ("heldout", heldout, ("prompt", "answer")),
    ):
        lines = (json.dumps({k: r[k] for k in keys}) + "\n" for r in rows)
        (data / f"{name}.jsonl").write_text("".join(lines))
    print(f"recipe: {params / 1e6:.1f}M-parameter model in {work / 'base'}; data in {data}", flush=True)


# ---------------------------------------------------------------------------------------------- eval
def heldout_em(model: torch.nn.Module, tokenizer: Any, rows: list[dict[str, str]], new_tokens: int) -> float:
    """Greedy exact match on `rows` (relayrl's native engine over `model` as it is now, `new_tokens` new tokens:
    recipe_task.MAX_NEW_TOKENS but at the tiny scale)."""
    settings = EngineSettings(max_seq_len=160, max_seqs=min(len(rows), 512))
    # eager decoding: a fresh engine per evaluation, so no CUDA graphs to capture each time
    engine = build_engine("native", model, tokenizer, settings, cuda_graphs=False)
    params = SamplingParams(n=1, temperature=0.0, max_new_tokens=new_tokens)
    try:
        requests = [GenerationRequest(prompt_ids=tokenizer.encode(r["prompt"]), params=params) for r in rows]
        results = generate_all(engine, requests)
    finally:
        engine.close()
    stops = {tokenizer.eos_token_id}
    texts = [decode_response(tokenizer, r.completions[0].token_ids, stops) for r in results]
    return sum(task.exact_match(t, r["answer"]) for t, r in zip(texts, rows, strict=True)) / len(rows)


def read_rows(path: Path) -> list[dict[str, str]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


class Curve:
    """OUT/<run>/curve.jsonl: held-out exact match over a run's wall time (evaluation time included)."""

    def __init__(self, out: Path, run: str, evaluate: Callable[[], float], every: float) -> None:
        self.path = out / run / "curve.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text("")
        self.evaluate, self.every, self.run = evaluate, every, run
        self.t0 = time.perf_counter()
        self.eval_s = 0.0
        self.next_at = 0.0
        self.points: list[dict[str, float]] = []

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def point(self, step: int) -> float:
        """Evaluate now and append the line."""
        t, t_eval = self.elapsed(), time.perf_counter()
        em = self.evaluate()
        self.eval_s += time.perf_counter() - t_eval
        row = {"t": round(t, 2), "step": step, "heldout_em": em, "eval_s": round(self.eval_s, 2)}
        self.points.append(row)
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        print(f"recipe {self.run}: t {t:.0f}s step {step} held-out exact match {em:.3f}", flush=True)
        self.next_at = t + self.every
        return em

    def due(self) -> bool:
        return self.elapsed() >= self.next_at


class BudgetSpent(Exception):
    """A run reached its wall-time budget (raised from the loop's hook to end the run there)."""


# ---------------------------------------------------------------------------------------------- sft
class SFTClock:
    """The SFT run's wall-time plan, checked before every optimizer step (from the recipe's collate, which the
    loop calls in this process): after `sft_seconds` export WORK/sft/final and start the control's curve;
    `rl_seconds` later end the run (BudgetSpent)."""

    def __init__(self, scale: Scale, work: Path, out: Path, heldout: list[dict[str, str]]) -> None:
        self.scale, self.work, self.out, self.heldout = scale, work, out, heldout
        self.t0 = time.perf_counter()
        self.steps = 0
        self.sft_steps = 0
        self.handle: Any = None
        self.curve: Curve | None = None

    def keep_handle(self, handle: Any, *_: Any) -> None:
        """Recipe.before_fit: the model role (in this process: handle.instance is the ModelWorker)."""
        self.handle = handle

    def wrap(
        self, make: Callable[..., Callable[[list[int]], list]]
    ) -> Callable[..., Callable[[list[int]], list]]:
        """Recipe.collate: the default collate, with `tick` before each step's batch."""

        def make_timed(samples: Any, train: Any, layout: str) -> Callable[[list[int]], list]:
            inner = make(samples, train, layout)

            def collate(indices: list[int]) -> list:
                self.tick()
                self.steps += 1
                return inner(indices)

            return collate

        return make_timed

    def evaluate(self) -> float:
        return heldout_em(
            self.handle.instance.model, self.handle.instance.tokenizer, self.heldout, self.scale.new_tokens
        )

    def tick(self) -> None:
        if self.curve is None:
            if time.perf_counter() - self.t0 >= self.scale.sft_seconds:
                self.checkpoint()
            return
        if self.curve.elapsed() >= self.scale.rl_seconds:
            self.curve.point(self.steps - self.sft_steps)
            raise BudgetSpent
        if self.curve.due():
            self.curve.point(self.steps - self.sft_steps)

    def checkpoint(self) -> None:
        """Export the model to WORK/sft/final (written aside, then renamed: the folder appears complete) and
        evaluate it: the t=0 point of the control's curve (and of every RL run's)."""
        seconds = time.perf_counter() - self.t0
        final, tmp = self.work / "sft" / "final", self.work / "sft" / "final.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        self.handle.call(ModelWorker.export, str(tmp))
        tmp.rename(final)
        self.sft_steps = self.steps
        self.curve = Curve(self.out, "sft_control", self.evaluate, self.scale.eval_seconds)
        em = self.curve.point(0)
        info = {"sft_steps": self.steps, "sft_seconds": round(seconds, 1), "sft_heldout_em": em}
        (self.out / "sft_control" / "sft.json").write_text(json.dumps(info) + "\n")
        print(f"recipe sft: {self.steps} steps in {seconds:.0f}s -> {final}", flush=True)


def run_sft_and_control(scale: Scale, work: Path, out: Path, seed: int, device: str) -> None:
    """SFT for scale.sft_seconds -> WORK/sft/final; the same run (relayrl's SFT loop, never restarted)
    continues on the same demonstrations as the more-SFT control for scale.rl_seconds."""
    shutil.rmtree(work / "sft", ignore_errors=True)
    (work / "sft").mkdir(parents=True)
    clock = SFTClock(scale, work, out, read_rows(work / "data" / "heldout.jsonl"))
    cfg = SFTConfig(
        model=ModelConfig(name_or_path=str(work / "base")),
        data=DataConfig(
            datasets=[str(work / "data" / "sft.jsonl")],
            input_key="prompt",
            output_key="completion",
            seed=seed,
        ),
        optim=OptimConfig(  # warmup_ratio 0: the step total is a placeholder (the wall time ends the run)
            lr=scale.sft_lr, warmup_steps=50, warmup_ratio=0.0, scheduler="constant", weight_decay=0.0
        ),
        train=TrainConfig(
            seed=seed,
            batch_size=scale.sft_batch,
            micro_batch_size=scale.sft_batch,
            max_steps=10**7,  # the wall-time plan ends the run
            log_every=50,
            device=device,  # type: ignore[arg-type]
            output_dir=str(work / "sft_run"),
        ),
        ckpt=CkptConfig(save_every=0, resume="none", overwrite=True),
        logger=LoggerConfig(progress_bar=False),
    )
    base = sft_recipe(cfg)
    default = base.collate or (
        lambda samples, train, layout: make_collate(samples, train, layout, base.to_batch)
    )
    with contextlib.suppress(BudgetSpent):
        run_recipe(dataclasses.replace(base, collate=clock.wrap(default), before_fit=clock.keep_handle))
    if clock.curve is None:
        raise RuntimeError("recipe sft: the run ended before its SFT budget; nothing was exported")


# ---------------------------------------------------------------------------------------------- rl
def rl_config(scale: Scale, work: Path, algo: str, seed: int, device: str) -> RLConfig:
    """relayrl rl from WORK/sft/final on the fresh prompts, reward = recipe_task.score (its reward_func)."""
    s = scale.rl
    return RLConfig(
        model=ModelConfig(name_or_path=str(work / "sft" / "final")),
        data=DataConfig(
            datasets=[str(work / "data" / "train_prompts.jsonl")],
            input_key="prompt",
            label_key="answer",
            seed=seed,
        ),
        optim=OptimConfig(
            lr=s["learning_rate"], warmup_steps=0, warmup_ratio=0.0, scheduler="constant", weight_decay=0.0
        ),
        train=RLTrainConfig(seed=seed, max_steps=10**6, device=device, output_dir=str(work / "rl" / algo)),  # type: ignore[arg-type]
        ckpt=CkptConfig(save_every=0, keep_last=1, resume="none", overwrite=True),
        logger=LoggerConfig(progress_bar=False),
        reward=RewardConfig(source=str(Path(task.__file__).resolve())),
        rollout=RolloutConfig(
            prompts_per_step=s["prompts_per_step"],
            n_samples=s["group_size"],
            temperature=s["temperature"],
            max_new_tokens=min(s["max_new_tokens"], scale.new_tokens),
            max_len=160,
        ),
        algo=AlgoConfig(preset=algo, kl_coef=0.0),
        critic=CriticConfig(lr=scale.critic_lr) if algo == "ppo" else CriticConfig(),  # PPO's: GAE
    )


def run_rl(scale: Scale, work: Path, out: Path, algo: str, seed: int, device: str) -> None:
    """One RL run for scale.rl_seconds from the SFT checkpoint (waits for it to appear)."""
    wait_for(work / "sft" / "final", timeout=scale.sft_seconds * 4 + 120)
    heldout = read_rows(work / "data" / "heldout.jsonl")
    trainer = RLTrainer(rl_config(scale, work, algo, seed, device), banner=False)
    role = trainer.roles.policy
    if not isinstance(role, LocalRole):  # dist.mode local (the default): the policy worker is in this process
        raise RuntimeError(
            "recipe rl: the held-out evaluation reads the policy in this process (dist.mode local)"
        )
    policy = role.instance

    curve = Curve(
        out,
        algo,
        lambda: heldout_em(policy.model, trainer.tokenizer, heldout, scale.new_tokens),
        scale.eval_seconds,
    )
    curve.point(0)

    def on_step(step: int, _: dict[str, float]) -> None:
        if curve.elapsed() >= scale.rl_seconds:
            curve.point(step)
            raise BudgetSpent
        if curve.due():
            curve.point(step)

    with contextlib.suppress(BudgetSpent):
        trainer.fit(on_step=on_step)
    metrics = work / "rl" / algo / "metrics.jsonl"
    if metrics.is_file():
        shutil.copy(metrics, out / algo / "metrics.jsonl")


def wait_for(path: Path, timeout: float) -> None:
    """Until the folder `path` exists; an error after `timeout` s or once `<path's parent>.failed` exists (what
    run_gpu.sh leaves when the build or SFT failed)."""
    t0 = time.perf_counter()
    failed = path.parent.with_name(path.parent.name + ".failed")
    while not path.is_dir():
        if failed.exists():
            raise RuntimeError(f"recipe: the SFT phase failed ({failed} exists; see its log); no RL run")
        if time.perf_counter() - t0 > timeout:
            raise TimeoutError(
                f"recipe: {path} did not appear within {timeout:.0f}s (did the SFT phase fail?)"
            )
        time.sleep(1.0)


# ---------------------------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("phase", choices=["prepare", "sft", "rl", "all"])
    p.add_argument("--scale", choices=sorted(SCALES), default="full")
    p.add_argument("--algo", choices=ALGOS, default="grpo", help="the rl phase's algorithm (relayrl preset)")
    p.add_argument("--work", default=os.environ.get("RECIPE_WORK", "/root/recipe"), help="model/data folder")
    p.add_argument("--out", default=os.environ.get("OUT", "runs/recipe"), help="curves, tables, logs")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--sft-rows", type=int, default=0, help="override the scale's number of demonstrations")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (CPU runs)")
    p.add_argument("--sft-seconds", type=float, default=0.0, help="override the scale's SFT wall time")
    p.add_argument(
        "--rl-seconds", type=float, default=0.0, help="override the scale's RL / control wall time"
    )
    args = p.parse_args(argv)
    if args.sft_rows < 0 or args.sft_seconds < 0 or args.rl_seconds < 0:
        p.error("--sft-rows, --sft-seconds and --rl-seconds take values >= 0 (0: the scale's own)")
    scale, work, out = scale_of(args), Path(args.work), Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(args.seed)
    if args.device == "cpu" or not torch.cuda.is_available():
        torch.set_num_threads(args.threads)  # one thread per process: 2-core machines thrash with more
    if args.phase in ("prepare", "all"):
        prepare(scale, work, args.seed)
    if args.phase in ("sft", "all"):
        run_sft_and_control(scale, work, out, args.seed, args.device)
    if args.phase == "rl":
        run_rl(scale, work, out, args.algo, args.seed, args.device)
    if args.phase == "all":
        for algo in ALGOS:
            run_rl(scale, work, out, algo, args.seed, args.device)
        write_results(out, {"scale": args.scale, **dataclasses.asdict(scale)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
