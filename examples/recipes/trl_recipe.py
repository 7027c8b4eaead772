"""The recipe's GRPO through TRL: GRPOTrainer with vLLM colocated, from the recipe's SFT checkpoint.

    torchrun --standalone --nproc_per_node 1 examples/recipes/trl_recipe.py     # one GPU, RL_SECONDS (270) of RL
    python examples/recipes/trl_recipe.py --cpu-smoke --work DIR --out DIR       # tiny CPU steps, no vLLM

Reads what the recipe wrote under $RECIPE_WORK (default /root/recipe): sft/final/ (HF model + tokenizer),
data/train_prompts.jsonl and data/heldout.jsonl (JSON lines with "prompt", the exact string fed to the model, and
"answer"). Writes $OUT/trl_grpo/curve.jsonl as it goes, one line per held-out evaluation:
{"t": seconds (Timing below), "step": optimizer steps, "heldout_em": greedy exact match, "eval_s": evaluation
seconds so far} (step 0 = the SFT model, t 0), and $OUT/trl_grpo/summary.json (settings with their sources, times, per-step reward, versions) at the end.

Held equal with relayrl's runs (examples/recipes/recipe_task.py): the prompts, the reward (`score`), the
held-out metric (`exact_match`, greedy, MAX_NEW_TOKENS), and RL_SETTINGS' group size, learning rate (constant,
no warmup), prompts per step, temperature and new tokens; AdamW as relayrl's defaults (betas 0.9/0.95, eps 1e-8,
no weight decay, grad-norm clip 1.0). One optimizer step per generation batch (prompts x group samples).

TRL's own choices, as its docs and GRPOConfig defaults give them: vLLM colocated on the training GPU (every
vLLM setting and its source: bench/peers/trl_vllm.py), loss_type "dapo" (token mean), beta 0 (no reference
model), PPO clip 0.2, advantages scaled by the group's std, one iteration per batch, bf16 autocast over fp32
weights. Changed from TRL's defaults: gradient checkpointing off (TRL turns it on to save memory; a ~100M model
has memory to spare, and it would cost TRL a recomputed forward) and `per_device_train_batch_size` 128 with
gradient accumulation to the batch (TRL's max_num_seqs for vLLM is that times the accumulation: the whole
generation batch in one vLLM call).

Timing, as the recipe's relayrl runs (examples/recipes/recipe.py, Curve): the clock starts once the trainer is
built (TRL's set-up, vLLM's start-up included, is `setup_s` in the summary, outside `t`); `t` is wall seconds
since then, evaluations included, and each line also carries `eval_s`, the evaluation seconds so far (so
`t - eval_s` is training time alone, for either side). Evaluation at t 0, then at the first step ending
--eval-seconds or more after the previous one; training stops at the first step that ends past --budget-s (that
step is evaluated) or at --max-steps. Defaults: the recipe's full scale (RL_SECONDS 270, eval every 30 s). The
evaluation is HF `generate` (greedy, batched, the training model itself under the trainer's bf16 autocast), not
vLLM: vLLM's weights are refreshed only before TRL's next generation.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # local folders only: no hub look-up can hang an offline machine
ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "examples" / "recipes"), str(ROOT / "bench" / "peers")]

import recipe_task  # noqa: E402  (examples/recipes: the task contract every side uses)
from trl_vllm import VLLM_COLOCATE, in_process_engine, vllm_config_kwargs, vllm_problem  # noqa: E402

RUN_NAME = "trl_grpo"
MICRO_BATCH = 128
"""Samples per forward/backward (TRL per_device_train_batch_size); gradient accumulation makes the batch."""
RECORDED = (
    "per_device_train_batch_size",
    "gradient_accumulation_steps",
    "steps_per_generation",
    "num_generations",
    "max_completion_length",
    "temperature",
    "learning_rate",
    "loss_type",
    "beta",
    "epsilon",
    "scale_rewards",
    "bf16",
    "gradient_checkpointing",
    "use_vllm",
    "vllm_mode",
)
"""GRPOConfig fields written to summary.json."""
SMOKE = {"prompts_per_step": 2, "group_size": 4, "max_new_tokens": 12}
"""--cpu-smoke: RL_SETTINGS overrides for a tiny CPU run."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--work", default=os.environ.get("RECIPE_WORK", "/root/recipe"), help="the recipe's folder"
    )
    p.add_argument("--out", default=os.environ.get("OUT", "runs/recipe"), help="curve goes to OUT/trl_grpo/")
    p.add_argument(
        "--budget-s",
        type=float,
        default=float(os.environ.get("RL_SECONDS", 270)),
        help="wall seconds of the run (evaluation included) after which training stops",
    )
    p.add_argument(
        "--eval-seconds", type=float, default=30.0, help="held-out evaluation every this many seconds"
    )
    p.add_argument("--max-steps", type=int, default=100_000, help="stop after this many steps at the latest")
    p.add_argument(
        "--heldout-rows", type=int, default=0, help="evaluate on the first N held-out rows (0: all)"
    )
    p.add_argument("--eval-batch", type=int, default=512, help="held-out prompts per generate call")
    p.add_argument("--cpu-smoke", action="store_true", help="CPU, model.generate, tiny settings (a test)")
    p.add_argument(
        "--start-after",
        default="",
        help="early set-up (run_gpu.sh): build the trainer from WORK/base as soon as WORK/prepared exists, write "
        "WORK/trl.ready, wait until this file exists, then load WORK/sft/final's weights and train; a number in "
        "the file replaces --budget-s, 'abort' ends the process",
    )
    p.add_argument(
        "--start-timeout", type=float, default=900.0, help="most seconds each --start-after wait takes"
    )
    return p.parse_args(argv)


def wait_for_file(path: Path, timeout: float, failed: Path | None = None) -> str:
    """The text of `path` once it exists (polled every 0.2 s); SystemExit when it reads "abort", when `failed`
    exists first, or after `timeout` s."""
    t0 = time.perf_counter()
    while not path.is_file():
        if failed is not None and failed.exists():
            sys.exit(f"trl_recipe: {failed} exists (the recipe's build or SFT failed); no TRL run")
        if time.perf_counter() - t0 > timeout:
            sys.exit(f"trl_recipe: {path} did not appear within {timeout:.0f}s (--start-after)")
        time.sleep(0.2)
    text = path.read_text().strip()
    if text == "abort":  # a decision of the caller (no time left, the runs before failed): not an error here
        print(f"trl_recipe: {path} says abort; no TRL run", flush=True)
        sys.exit(0)
    print(f"trl_recipe: {path} appeared after {time.perf_counter() - t0:.0f}s", flush=True)
    return text


def budget_in(text: str, where: str) -> float | None:
    """The budget (seconds > 0) a --start-after file holds, None when it holds no number."""
    try:
        budget = float(text.split()[0])
    except (ValueError, IndexError):
        return None
    if not (budget > 0 and budget < float("inf")):
        sys.exit(f"trl_recipe: {where} holds budget {budget}; expected seconds > 0")
    return budget


def load_weights(model: Any, folder: Path) -> None:
    """Copy the weights of the HF model in `folder` into `model` (same architecture: every parameter's name and
    shape must match), in place, so what the trainer holds (its optimizer is made in train()) stays the same."""
    import torch
    from transformers import AutoModelForCausalLM

    source = dict(AutoModelForCausalLM.from_pretrained(str(folder)).named_parameters())
    target = dict(model.named_parameters())
    if source.keys() != target.keys():
        raise ValueError(
            f"{folder}: parameters differ from the trainer's model ({sorted(source.keys() ^ target.keys())[:4]})"
        )
    with torch.no_grad():
        for name, p in target.items():
            if p.shape != source[name].shape:
                raise ValueError(
                    f"{folder}: {name} has shape {tuple(source[name].shape)}, not {tuple(p.shape)}"
                )
            p.copy_(source[name])


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} is missing: run the recipe's data + SFT stages first (RECIPE_WORK={path})"
        )
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    for i, row in enumerate(rows):
        if not isinstance(row.get("prompt"), str) or "answer" not in row:
            raise ValueError(f"{path} line {i + 1}: expected a JSON object with 'prompt' (str) and 'answer'")
    return rows


def settings(args: argparse.Namespace) -> dict[str, Any]:
    """RL_SETTINGS, with the smoke overrides on --cpu-smoke."""
    s = dict(recipe_task.RL_SETTINGS)
    if args.cpu_smoke:
        s.update(SMOKE)
    return s


def recipe_reward(completions: list[str], answer: list[str], **kwargs: Any) -> list[float]:
    """The recipe's reward (`recipe_task.score`) of each completion; TRL passes the dataset's answer column."""
    return [float(recipe_task.score(c, str(a))) for c, a in zip(completions, answer, strict=True)]


def grpo_config(args: argparse.Namespace, s: dict[str, Any], output_dir: Path) -> Any:
    """The GRPOConfig of the run (module doc: what is held equal, what is TRL's)."""
    from trl import GRPOConfig

    n = s["prompts_per_step"] * s["group_size"]
    micro = min(MICRO_BATCH, n)
    if n % micro:
        raise ValueError(f"prompts_per_step x group_size = {n} must be a multiple of the micro-batch {micro}")
    engine: dict[str, Any] = {"use_vllm": False} if args.cpu_smoke else vllm_config_kwargs()
    return GRPOConfig(
        output_dir=str(output_dir),
        max_steps=args.max_steps,
        per_device_train_batch_size=micro,
        gradient_accumulation_steps=n
        // micro,  # steps_per_generation defaults to this: 1 generation per step
        num_generations=s["group_size"],
        max_completion_length=s["max_new_tokens"],
        temperature=s["temperature"],
        top_p=1.0,
        top_k=0,
        **engine,
        beta=0.0,
        loss_type="dapo",
        epsilon=0.2,
        scale_rewards="group",
        num_iterations=1,
        learning_rate=s["learning_rate"],
        lr_scheduler_type="constant",
        warmup_steps=0,
        adam_beta1=0.9,
        adam_beta2=0.95,
        adam_epsilon=1e-8,
        weight_decay=0.0,
        max_grad_norm=1.0,
        bf16=not args.cpu_smoke,
        use_cpu=args.cpu_smoke,
        gradient_checkpointing=False,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        seed=0,
    )


def heldout_em(model: Any, tok: Any, rows: list[dict[str, Any]], max_new_tokens: int, batch: int) -> float:
    """Greedy exact match (`recipe_task.exact_match`) of `model` over `rows`, batched HF generate, left padding;
    under bf16 autocast on a GPU (the trainer's precision)."""
    import contextlib

    import torch
    from transformers import GenerationConfig

    eos = model.generation_config.eos_token_id or tok.eos_token_id
    gen = GenerationConfig(
        do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=eos, pad_token_id=tok.pad_token_id
    )
    device = next(model.parameters()).device
    autocast = torch.autocast("cuda", torch.bfloat16) if device.type == "cuda" else contextlib.nullcontext()
    was_training, hits = model.training, 0
    model.eval()
    with torch.no_grad(), autocast:
        for i in range(0, len(rows), batch):
            chunk = rows[i : i + batch]
            enc = tok([r["prompt"] for r in chunk], return_tensors="pt", padding=True, padding_side="left")
            out = model.generate(**enc.to(device), generation_config=gen)
            texts = tok.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
            hits += sum(
                recipe_task.exact_match(t, str(r["answer"])) for t, r in zip(texts, chunk, strict=True)
            )
    model.train(was_training)
    return hits / len(rows)


def make_curve_callback(
    args: argparse.Namespace, s: dict[str, Any], heldout: list[dict[str, Any]], out: Path
):
    """A TrainerCallback that starts the clock, evaluates at t 0, every --eval-seconds and at the last step,
    writes curve lines as it goes and stops training at the budget (module doc: Timing)."""
    import torch
    from transformers import TrainerCallback

    def now() -> float:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return time.perf_counter()

    class Curve(TrainerCallback):
        def __init__(self) -> None:
            self.points: list[dict[str, float]] = []
            self.logs: dict[int, dict[str, float]] = {}
            self.t0 = self.eval_s = 0.0
            self.next_at = 0.0
            self.last_eval_step = -1

        def elapsed(self) -> float:
            return now() - self.t0

        def evaluate(self, step: int, model: Any, tok: Any) -> None:
            t = self.elapsed()
            em = heldout_em(model, tok, heldout, s["max_new_tokens"], args.eval_batch)
            took = self.elapsed() - t
            self.eval_s += took
            point = {"t": round(t, 3), "step": step, "heldout_em": em, "eval_s": round(self.eval_s, 3)}
            self.points.append(point)
            self.last_eval_step, self.next_at = step, t + args.eval_seconds
            with (out / "curve.jsonl").open("a") as f:
                f.write(json.dumps(point) + "\n")
            print(
                f"trl_recipe: t {t:.1f}s step {step} held-out exact match {em:.3f} (eval {took:.1f}s)",
                flush=True,
            )

        def on_train_begin(self, a, state, control, model=None, processing_class=None, **kw):
            self.t0 = now()
            self.evaluate(0, model, processing_class)

        def on_step_end(self, a, state, control, model=None, processing_class=None, **kw):
            if self.elapsed() >= args.budget_s or state.global_step >= args.max_steps:
                control.should_training_stop = True
            if control.should_training_stop or self.elapsed() >= self.next_at:
                self.evaluate(state.global_step, model, processing_class)

        def on_train_end(self, a, state, control, model=None, processing_class=None, **kw):
            if self.last_eval_step != state.global_step:  # stopped some other way (the dataset ran out)
                self.evaluate(state.global_step, model, processing_class)

        def on_log(self, a, state, control, logs=None, **kw):
            self.logs.setdefault(state.global_step, {}).update(logs or {})

    return Curve()


def versions() -> dict[str, str]:
    out = {}
    for name in ("torch", "transformers", "trl", "accelerate", "datasets", "vllm"):
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = "not installed"
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    t_start = time.perf_counter()
    args = parse_args(argv)
    work, out = Path(args.work), Path(args.out) / RUN_NAME
    sft = work / "sft" / "final"
    early = bool(args.start_after)
    if not early and not (sft / "config.json").is_file():
        sys.exit(
            f"trl_recipe: no SFT checkpoint at {sft}: run the recipe's SFT first, or set RECIPE_WORK / --work"
        )
    if not args.cpu_smoke and (problem := vllm_problem()):
        sys.exit(f"trl_recipe: {problem} (or run --cpu-smoke for the model.generate path)")
    if not args.cpu_smoke:
        in_process_engine()
        if early:
            import vllm  # noqa: F401  # pyright: ignore[reportMissingImports]  (seconds long: import it while waiting)
    import datasets
    import torch
    from trl import GRPOTrainer

    if early:  # the base model and the data, written by the recipe's prepare phase
        wait_for_file(work / "prepared", args.start_timeout, failed=work / "sft.failed")
    s = settings(args)
    train = read_jsonl(work / "data" / "train_prompts.jsonl")
    heldout = read_jsonl(work / "data" / "heldout.jsonl")
    heldout = heldout[: args.heldout_rows] if args.heldout_rows else heldout
    out.mkdir(parents=True, exist_ok=True)
    (out / "curve.jsonl").write_text("")  # a fresh curve
    dataset = datasets.Dataset.from_list([{"prompt": r["prompt"], "answer": str(r["answer"])} for r in train])
    curve = make_curve_callback(args, s, heldout, out)
    config = grpo_config(args, s, Path(tempfile.mkdtemp(prefix="trl_recipe-")))  # TRL saves nothing there
    t0 = time.perf_counter()
    trainer = GRPOTrainer(
        model=str(work / "base" if early else sft),
        reward_funcs=recipe_reward,
        args=config,
        train_dataset=dataset,
        callbacks=[curve],
    )
    setup_s = time.perf_counter() - t0
    load_s = 0.0
    if early:
        # the same architecture and tokenizer as the SFT checkpoint: only the weights change. vLLM receives
        # them from the trainer's model at the first step, as after every step (TRL's _last_loaded_step -1)
        (work / "trl.ready").write_text(f"{setup_s:.1f}\n")
        print(
            f"trl_recipe: trainer built from {work / 'base'} in {setup_s:.0f}s; waiting for {args.start_after}"
        )
        budget = budget_in(wait_for_file(Path(args.start_after), args.start_timeout), args.start_after)
        args.budget_s = args.budget_s if budget is None else budget
        t1 = time.perf_counter()
        load_weights(trainer.model, sft)
        load_s = time.perf_counter() - t1
    trainer.train()
    last = curve.points[-1]
    summary = {
        "run": RUN_NAME,
        "sft": str(sft),
        "settings": s,
        "trl_settings": {k: str(getattr(config, k)) for k in RECORDED},
        "vllm_settings": {}
        if args.cpu_smoke
        else {k: {"value": v, "why": w} for k, (v, w) in VLLM_COLOCATE.items()},
        "steps": curve.points[-1]["step"],
        "sft_em": curve.points[0]["heldout_em"],
        "final_em": curve.points[-1]["heldout_em"],
        "best_em": max(p["heldout_em"] for p in curve.points),
        "run_s": last["t"],
        "train_s": round(last["t"] - last["eval_s"], 3),
        "eval_s": last["eval_s"],
        "setup_s": round(setup_s, 3),
        "weights_load_s": round(load_s, 3),
        "trainer_built_from": str(work / "base") if early else str(sft),
        "wall_s": round(time.perf_counter() - t_start, 3),
        "budget_s": args.budget_s,
        "eval_seconds": args.eval_seconds,
        "heldout_rows": len(heldout),
        "per_step": {
            step: {k: v for k, v in logs.items() if isinstance(v, int | float)}
            for step, logs in curve.logs.items()
        },
        "device": torch.cuda.get_device_name(0)
        if torch.cuda.is_available() and not args.cpu_smoke
        else "cpu",
        "versions": versions(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(
        f"trl_recipe: {summary['steps']} steps, {summary['train_s']:.0f}s training + {summary['eval_s']:.0f}s eval + "
        f"{setup_s:.0f}s set-up; held-out EM {summary['sft_em']:.3f} -> {summary['final_em']:.3f}; wrote {out}"
    )
    return summary


def exit_now() -> None:
    """End the process at once, everything written: an in-process vLLM engine (0.21 and later) can keep
    non-daemon threads alive and hang the interpreter's exit after the work is done."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    smoke = "--cpu-smoke" in sys.argv
    main()
    if not smoke:
        exit_now()
