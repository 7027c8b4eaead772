"""A GPU recipe that learns from nothing downloadable: SFT, then GRPO / PPO / REINFORCE++ from the same checkpoint.

    python examples/recipes/recipe.py all --scale tiny --out OUT --work WORK      # every phase, one process
    python examples/recipes/recipe.py prepare --scale full --work WORK            # model + tokenizer + data
    python examples/recipes/recipe.py sft --scale full --work WORK --out OUT      # SFT, then the more-SFT control
    python examples/recipes/recipe.py prepare-sft ...                             # both in one process
    python examples/recipes/recipe.py rl --algo grpo --scale full --work WORK --out OUT
    python examples/recipes/plot.py OUT                                           # curves.png + results.{md,json}

(run_gpu.sh runs these on a 4-GPU host: SFT and its control on GPU 0, one RL algorithm on each of GPUs 1-3, then
TRL's GRPO beside a second relayrl GRPO run. recipe_scales.py: each scale's sizes, budgets, SFT stop rule and
the RL config.)

Phases, all through relayrl's Python API as a user would call it:
  prepare  a Qwen2-shaped model with random weights and the character-level tokenizer
           (relayrl.models.tiny at the scale's shape; ~100M parameters at --scale full), and three disjoint
           sets of problems (recipe_task.py): a FIXED, SMALL set of worked demonstrations for SFT, fresh RL
           prompts, held-out prompts, and validation prompts for the SFT stop rule.
  sft      relayrl's SFT recipe (relayrl.trainers.sft.sft_recipe, run by relayrl.trainers.recipe.run_recipe) on
           the demonstrations until the scale's stop rule (recipe_scales.Scale.sft_stop: validation exact
           match at a target, a fixed step count, or `sft_seconds`); the model is then exported to WORK/sft/final
           (the checkpoint every RL run starts from), and the same run CONTINUES for `rl_seconds` as the
           more-SFT control, evaluated every `eval_seconds` (OUT/sft_control/curve.jsonl).
  rl       relayrl.trainers.rl.loop.RLTrainer from WORK/sft/final with the task's reward (recipe_task.score,
           through reward_func), for `rl_seconds` of wall time, evaluated every `eval_seconds`
           (OUT/<algo>/curve.jsonl, or OUT/<--run-name>/). The t=0 point of every curve is the SFT model.

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
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import recipe_task as task
from plot import write_results
from recipe_scales import ALGOS, SCALES, Scale, rl_config, scale_of

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
from relayrl.data.packing import make_collate
from relayrl.distributed.launch.local import LocalRole
from relayrl.models.tiny import build_tiny_model, build_tiny_tokenizer
from relayrl.rollout.base import EngineSettings, GenerationRequest, SamplingParams, generate_all
from relayrl.rollout.build import build_engine
from relayrl.trainers.recipe import run_recipe
from relayrl.trainers.rl.loop import RLTrainer
from relayrl.trainers.sft import sft_recipe
from relayrl.workers.trained import ModelWorker


# ---------------------------------------------------------------------------------------------- prepare
def prepare(scale: Scale, work: Path, seed: int) -> None:
    """WORK/base (model + tokenizer) and WORK/data/{sft,train_prompts,heldout,validation}.jsonl (disjoint
    problems; validation: the SFT stop rule's, recipe_scales.py)."""
    (work / "prepared").unlink(missing_ok=True)
    tok = build_tiny_tokenizer()
    model = build_tiny_model(tok, dataclasses.replace(scale.model, seed=seed))
    model.save_pretrained(work / "base")
    tok.save_pretrained(work / "base")
    params = sum(p.numel() for p in model.parameters())
    heldout = task.make_rows(scale.heldout_rows, seed + 1, digits=scale.digits)
    sft = task.make_rows(scale.sft_rows, seed + 2, {r["prompt"] for r in heldout}, scale.digits)
    rl = task.make_rows(scale.rl_rows, seed + 3, {r["prompt"] for r in heldout + sft}, scale.digits)
    val = task.make_rows(scale.val_rows, seed + 4, {r["prompt"] for r in heldout + sft + rl}, scale.digits)
    data = work / "data"
    data.mkdir(parents=True, exist_ok=True)
    for name, rows, keys in (
        ("sft", sft, ("prompt", "completion", "answer")),
        ("train_prompts", rl, ("prompt", "answer")),
        ("heldout", heldout, ("prompt", "answer")),
        ("validation", val, ("prompt", "answer")),
    ):
        lines = (json.dumps({k: r[k] for k in keys}) + "\n" for r in rows)
        (data / f"{name}.jsonl").write_text("".join(lines))
    (work / "prepared").write_text(f"{params}\n")  # the marker another side waits for (trl_recipe.py)
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
    """The SFT run's plan, checked before every optimizer step (from the recipe's collate, which the loop calls
    in this process): once `Scale.sft_stop` says so (a step count, validation exact match at the target, or
    the `sft_seconds` cap) export WORK/sft/final and start the control's curve; `rl_seconds` later end the
    run (BudgetSpent)."""

    def __init__(
        self, scale: Scale, work: Path, out: Path, heldout: list[dict[str, str]], val: list[dict[str, str]]
    ) -> None:
        self.scale, self.work, self.out, self.heldout, self.val = scale, work, out, heldout, val
        self.t0 = time.perf_counter()
        self.steps = 0
        self.sft_steps = 0
        self.handle: Any = None
        self.curve: Curve | None = None
        self.checks: list[dict[str, float]] = []
        """The SFT phase's validation checks: {"step", "t", "val_em"}."""

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

    def evaluate(self, rows: list[dict[str, str]] | None = None) -> float:
        w = self.handle.instance
        return heldout_em(w.model, w.tokenizer, self.heldout if rows is None else rows, self.scale.new_tokens)

    def validate(self) -> float:
        """Validation exact match now (the stop rule's; not a point of any curve)."""
        em = self.evaluate(self.val)
        t = time.perf_counter() - self.t0
        self.checks.append({"step": self.steps, "t": round(t, 1), "val_em": em})
        print(f"recipe sft: step {self.steps} ({t:.0f}s) validation exact match {em:.3f}", flush=True)
        return em

    def tick(self) -> None:
        if self.curve is None:
            val = self.validate() if self.scale.checks_at(self.steps) else None
            reason = self.scale.sft_stop(self.steps, time.perf_counter() - self.t0, val)
            if reason is not None:
                self.checkpoint(reason)
            return
        if self.curve.elapsed() >= self.scale.rl_seconds:
            self.curve.point(self.steps - self.sft_steps)
            raise BudgetSpent
        if self.curve.due():
            self.curve.point(self.steps - self.sft_steps)

    def checkpoint(self, reason: str) -> None:
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
        info = {
            "sft_steps": self.steps,
            "sft_seconds": round(seconds, 1),
            "sft_heldout_em": em,
            "stopped_by": reason,
            "sft_target_em": self.scale.sft_target_em,
            "validation_checks": self.checks,
        }
        (self.out / "sft_control" / "sft.json").write_text(json.dumps(info) + "\n")
        print(f"recipe sft: {self.steps} steps in {seconds:.0f}s ({reason}) -> {final}", flush=True)


def run_sft_and_control(scale: Scale, work: Path, out: Path, seed: int, device: str) -> None:
    """SFT until `Scale.sft_stop` -> WORK/sft/final; the same run (relayrl's SFT loop, never restarted)
    continues on the same demonstrations as the more-SFT control for scale.rl_seconds."""
    shutil.rmtree(work / "sft", ignore_errors=True)
    (work / "sft").mkdir(parents=True)
    data = work / "data"
    val = read_rows(data / "validation.jsonl") if (data / "validation.jsonl").is_file() else []
    if scale.sft_target_em and not val:
        raise FileNotFoundError(
            f"recipe sft: {data / 'validation.jsonl'} is missing: run the prepare phase again"
        )
    clock = SFTClock(scale, work, out, read_rows(data / "heldout.jsonl"), val)
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
def run_rl(scale: Scale, work: Path, out: Path, algo: str, seed: int, device: str, run: str = "") -> None:
    """One RL run for scale.rl_seconds from the SFT checkpoint (waits for it to appear); `run`: its folder
    name under OUT and WORK/rl (default: the algorithm's)."""
    run = run or algo
    wait_for(work / "sft" / "final", timeout=scale.sft_seconds * 4 + 120)
    heldout = read_rows(work / "data" / "heldout.jsonl")
    trainer = RLTrainer(rl_config(scale, work, algo, seed, device, run), banner=False)
    role = trainer.roles.policy
    if not isinstance(role, LocalRole):  # dist.mode local (the default): the policy worker is in this process
        raise RuntimeError(
            "recipe rl: the held-out evaluation reads the policy in this process (dist.mode local)"
        )
    policy = role.instance

    curve = Curve(
        out,
        run,
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
    metrics = work / "rl" / run / "metrics.jsonl"
    if metrics.is_file():
        shutil.copy(metrics, out / run / "metrics.jsonl")


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


def wait_to_start(path: Path, seconds: float) -> float:
    """Until `path` exists; the budget it holds (a number of seconds), else `seconds`. SystemExit(0) when it
    reads "abort"."""
    while not path.is_file():
        time.sleep(0.2)
    text = path.read_text().strip()
    if text == "abort":  # the caller's decision (no time left for the run): not an error here
        print(f"recipe: {path} says abort; no run", flush=True)
        sys.exit(0)
    try:
        budget = float(text.split()[0])
    except (ValueError, IndexError):
        return seconds
    if not 0 < budget < float("inf"):
        sys.exit(f"recipe: {path} holds budget {budget}; expected seconds > 0")
    return budget


# ---------------------------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("phase", choices=["prepare", "sft", "prepare-sft", "rl", "all"])
    p.add_argument("--scale", choices=sorted(SCALES), default="full")
    p.add_argument("--algo", choices=ALGOS, default="grpo", help="the rl phase's algorithm (relayrl preset)")
    p.add_argument("--run-name", default="", help="the rl phase's folder under OUT (default: the algorithm)")
    p.add_argument("--work", default=os.environ.get("RECIPE_WORK", "/root/recipe"), help="model/data folder")
    p.add_argument("--out", default=os.environ.get("OUT", "runs/recipe"), help="curves, tables, logs")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--sft-rows", type=int, default=0, help="override the scale's number of demonstrations")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (CPU runs)")
    p.add_argument(
        "--sft-seconds", type=float, default=0.0, help="override the scale's SFT wall time (the cap)"
    )
    p.add_argument(
        "--sft-steps", type=int, default=0, help="SFT for exactly this many steps (no validation checks)"
    )
    p.add_argument(
        "--sft-target-em",
        type=float,
        default=0.0,
        help="stop SFT once validation exact match reaches this (0: the scale's rule)",
    )
    p.add_argument(
        "--rl-seconds", type=float, default=0.0, help="override the scale's RL / control wall time"
    )
    p.add_argument(
        "--eval-seconds", type=float, default=0.0, help="override the scale's held-out evaluation interval"
    )
    p.add_argument(
        "--start-after",
        default="",
        help="rl: wait until this file exists before building the run; a number in it replaces --rl-seconds, "
        "'abort' ends the process (run_gpu.sh's head-to-head)",
    )
    args = p.parse_args(argv)
    numbers = ("sft_rows", "sft_seconds", "sft_steps", "rl_seconds", "eval_seconds")
    if any(getattr(args, k) < 0 for k in numbers):
        p.error(
            "--sft-rows, --sft-seconds, --sft-steps, --rl-seconds, --eval-seconds take values >= 0 (0: the scale's own)"
        )
    if not 0.0 <= args.sft_target_em <= 1.0:
        p.error(f"--sft-target-em {args.sft_target_em}: an exact match in [0, 1] (0: the scale's rule)")
    scale, work, out = scale_of(args), Path(args.work), Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(args.seed)
    if args.device == "cpu" or not torch.cuda.is_available():
        torch.set_num_threads(args.threads)  # one thread per process: 2-core machines thrash with more
    if args.phase in ("prepare", "prepare-sft", "all"):
        prepare(scale, work, args.seed)
    if args.phase in ("sft", "prepare-sft", "all"):
        run_sft_and_control(scale, work, out, args.seed, args.device)
    if args.phase == "rl" and args.start_after:
        scale = dataclasses.replace(scale, rl_seconds=wait_to_start(Path(args.start_after), scale.rl_seconds))
    if args.phase == "rl":
        run_rl(scale, work, out, args.algo, args.seed, args.device, args.run_name)
    if args.phase == "all":
        for algo in ALGOS:
            run_rl(scale, work, out, algo, args.seed, args.device)
        write_results(out, {"scale": args.scale, **dataclasses.asdict(scale)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
