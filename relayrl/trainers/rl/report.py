"""What the user sees during and after `relayrl rl`: the progress line, the per-step sample table
(console + <run>/samples.jsonl) and the PNG of the main curves.

    Timer                           timing/<phase> seconds of one step (`with timer("update"): ...`)
    RLProgress                      step/total, reward, KL, response length, step time, ETA
    log_samples(trajs, step, run_dir, console=, tokenizer=)   a few prompt / response / reward rows per step
    plot_curves(metrics_jsonl, png)               reward, KL, response length and eval accuracy over steps
    banner_text(cfg, info, run_dir, on_policy)    the start-up line of a run

Samples: <run>/samples.jsonl gets a few rows every step, with the raw text (the templated prompt, the
decoded response). The console table (every `train.log_every` steps, with logger.progress_bar) shows a
readable view: the tokenizer's special tokens (<|im_start|>, <|im_end|>, ...) dropped, a chat prompt as
"[role] content" lines, and a multi-turn response as one line per run of tokens, "[assistant] ..." for the
policy's (action_mask True) and "[env] ..." for the environment's (tool results, observations, hints).
"""

from __future__ import annotations

import itertools
import json
import math
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from relayrl.agents.base import Trajectory
from relayrl.config.rl import RLConfig
from relayrl.data.records import PromptSample
from relayrl.training.logging import ConsoleProgress, _scalar, read_jsonl

SAMPLES_FILE = "samples.jsonl"


class Timer:
    """Seconds per named phase of one step (a phase entered twice adds up)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t0

    def metrics(self) -> dict[str, float]:
        """timing/<phase> for every phase timed."""
        return {f"timing/{k}": v for k, v in self.seconds.items()}


class RLProgress(ConsoleProgress):
    """ConsoleProgress showing RL quantities instead of SFT's loss / tokens/s."""

    FIELDS = (
        ("rollout/reward_mean", "reward", "{:.3f}"),
        ("rollout/kl", "kl", "{:.4f}"),
        ("rollout/response_len", "len", "{:.1f}"),
        ("eval/pass@1", "eval", "{:.3f}"),
        ("timing/step", "step_s", "{:.2f}"),
    )

    @staticmethod
    def describe(metrics: Mapping[str, Any]) -> str:
        parts = []
        for key, label, fmt in RLProgress.FIELDS:
            value = _scalar(metrics[key]) if key in metrics else None
            if value is not None and math.isfinite(value):
                parts.append(f"{label} {fmt.format(value)}")
        dropped = metrics.get("filter/groups_dropped")
        if dropped:  # dynamic filtering: how many groups went, how many refill rounds it took
            parts.append(
                f"filtered {_scalar(dropped):.0f} groups, {_scalar(metrics.get('filter/refills', 0)):.0f} refills"
            )
        return "  ".join(parts)


def log_samples(
    trajs: list[Trajectory], step: int, run_dir: Path, *, console: bool, tokenizer: Any, k: int = 4
) -> None:
    """Append `k` samples (one per prompt first) to samples.jsonl (raw text); print them as a table when
    `console`, in the readable view of `prompt_view` / `response_view`."""
    seen, picked = set(), []
    for t in trajs:
        if t.sample.index not in seen:
            seen.add(t.sample.index)
            picked.append(t)
        if len(picked) == k:
            break
    rows = [
        {
            "step": step,
            "prompt": t.sample.prompt,
            "response": t.response_text,
            "reward": t.reward,
            "label": t.sample.label if isinstance(t.sample.label, str | int | float) else str(t.sample.label),
        }
        for t in picked
    ]
    with (run_dir / SAMPLES_FILE).open("a") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    if console and rows:
        from rich.console import Console
        from rich.table import Table
        from rich.text import Text  # cells as Text: "[env]" or a "[...]" in a prompt is not rich markup

        specials = special_token_texts(tokenizer)
        table = Table(title=f"samples, step {step}", show_lines=False)
        for col in ("prompt", "response", "reward", "label"):
            table.add_column(col, overflow="fold", max_width=60)
        for t, r in zip(picked, rows, strict=True):
            prompt, response = prompt_view(t.sample, specials), response_view(t, tokenizer, specials)
            table.add_row(Text(prompt[-60:]), Text(response[:240]), f"{r['reward']}", Text(str(r["label"])))
        Console().print(table)


def special_token_texts(tokenizer: Any) -> list[str]:
    """The tokenizer's special tokens as text (<|im_start|>, <|im_end|>, added special tokens), longest first."""
    names = set(getattr(tokenizer, "all_special_tokens", None) or [])
    for added in (getattr(tokenizer, "added_tokens_decoder", None) or {}).values():
        if getattr(added, "special", False):
            names.add(str(added))
    return sorted((n for n in names if n), key=len, reverse=True)


def strip_special(text: str, specials: list[str]) -> str:
    """`text` without any of the special-token strings `specials`, stripped of outer whitespace."""
    for name in specials:
        text = text.replace(name, "")
    return text.strip()


def prompt_view(sample: PromptSample, specials: list[str]) -> str:
    """A chat prompt as "[role] content" lines; a templated text prompt without its special tokens."""
    if sample.messages:
        return "\n".join(f"[{m['role']}] {m['content']}" for m in sample.messages)
    return strip_special(sample.prompt, specials)


def response_view(t: Trajectory, tokenizer: Any, specials: list[str]) -> str:
    """The response without special tokens. Multi-turn (several turns, or environment tokens after the prompt):
    one line per run of tokens, "[assistant] ..." where action_mask is True, "[env] ..." where it is False."""
    ids, mask = t.token_ids[t.prompt_len :], t.action_mask[t.prompt_len :]
    if t.num_turns <= 1 and all(mask):
        return strip_special(t.response_text, specials)
    lines = []
    for is_action, run in itertools.groupby(zip(ids, mask, strict=True), key=lambda pair: pair[1]):
        text = strip_special(tokenizer.decode([i for i, _ in run], skip_special_tokens=True), specials)
        lines.append(f"[{'assistant' if is_action else 'env'}] {text}")
    return "\n".join(lines)


PLOTS = (
    ("rollout/reward_mean", "reward (train)"),
    ("rollout/kl", "KL to reference"),
    ("rollout/response_len", "response length"),
    ("eval/pass@1", "eval accuracy (pass@1)"),
)


def plot_curves(metrics_path: Path, png: Path, title: str = "relayrl rl") -> Path | None:
    """A 2x2 PNG of the main curves from metrics.jsonl (panels without data say so); None if no rows."""
    if not Path(metrics_path).is_file():
        return None
    rows = read_jsonl(metrics_path)
    if not rows:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    for ax, (key, label) in zip(axes.flat, PLOTS, strict=True):
        pts = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
        if pts:
            xs, ys = zip(*pts, strict=True)
            ax.plot(xs, ys, marker="o" if len(pts) < 30 else None)
        else:
            ax.text(0.5, 0.5, "not measured", ha="center", va="center", transform=ax.transAxes)
        ax.set_title(label)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=100)
    plt.close(fig)
    return png


def banner_text(cfg: RLConfig, info: dict, run_dir: Path, on_policy: bool) -> str:
    """The start-up line: algorithm, model, precision, layout, engine, ranks, steps, run folder."""
    a = cfg.algo
    fp8 = " in fp8" if cfg.rollout.quantization == "fp8" else ""
    return (
        f"relayrl rl: {a.preset or 'custom'} (advantage {a.advantage}, loss {a.policy_loss}, kl {a.kl_mode}) on "
        f"{cfg.model.name_or_path} ({info['params'] / 1e6:.1f}M params, {info['precision']}, "
        f"{info['layout']} attention, engine {cfg.rollout.engine} on {info['engine_weights']} weights{fp8}), "
        f"{info.get('ranks', 1)} policy rank(s), {cfg.train.max_steps} steps of {cfg.rollout.prompts_per_step} "
        f"x {cfg.rollout.n_samples} samples, old-log-prob pass "
        f"{'skipped (exactly on-policy)' if on_policy else 'on'}; run folder {run_dir}"
    )
