"""`relayrl generate`: batch inference with the rollout engine, optional scoring and selection, one JSONL file.

OpenRLHF's batch_inference (generate, then score with a reward) and its post-processors (best-of-n, which
OpenRLHF calls rejection sampling; iterative-DPO pairs; conditional SFT, Hu et al. 2023 arXiv 2308.12050 /
SteerLM) in one command whose output `relayrl sft` (or a DPO trainer) reads directly:

    prompts    data files through relayrl.data.build_prompt_data (the same templating as `relayrl rl`), or a
               built-in task's train rows (`task.name`)
    sample     `rollout.n_samples` completions per prompt on `rollout.engine` (native by default); the
               request seed of a prompt is derived from `seed` and its index, so a seed gives one file
    score      `reward.source` (any build_reward_source spec; `task:<name>` by default with `task.name`);
               a reward that raises, times out, returns NaN or a bad output marks the sample FAILED (counted
               by kind, never a silent zero). A reward_func file is called once per prompt (its n samples),
               so a raise fails that prompt's samples only.
    select     all | best_of_n | rejection | pairs | conditional  (SELECTORS; docs/generate.md has a row each)
    write      <output> atomically (temp file + rename), the resolved config beside it (<stem>.config.yaml)

Rows: "input" is the prompt exactly as the model saw it (chat template / input_template already applied), so
train on the file with the default data flags (no --data.apply_chat_template, no --data.input_template).
SFT rows hold "input", "output", "reward" (with a reward) and "label" (when the prompt has one); pairs rows
hold "input", "chosen", "rejected", "chosen_reward", "rejected_reward" (+ "label"). Samples whose response
is empty are never written (SFT cannot learn from them), failed samples only by `all` (reward null and their
"failure" kind), and a selection never picks a failed sample.

Departures from OpenRLHF: `rejection` is a threshold filter (keep every sample with reward >= threshold, at
most the best `max_per_prompt` per prompt); OpenRLHF's "rejection_sampling" processor is our `best_of_n`.
The conditional template formats the raw reward (no normalisation over the file), puts the score before the
prompt by default (DEFAULT_CONDITION) and, for chat prompts, goes into the last user message rather than
around the rendered prompt.

Programmatic use (iterative DPO): `result = run_generate(cfg, model=policy, tokenizer=tok)`; `result.rows`.
"""

from __future__ import annotations

import asyncio
import json
import os
import tempfile
import time
import warnings
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from relayrl.agents.base import Trajectory, TrajectoryStatus
from relayrl.agents.executors import SingleTurnExecutor
from relayrl.agents.failures import FailureLog
from relayrl.agents.rewards import build_reward_source, parse_reward_spec, resolve_reward_spec
from relayrl.apps.selection import SELECTORS, SelectOptions
from relayrl.config.base import ConfigError, ConfigWarning, save_yaml
from relayrl.config.command_line import run_command
from relayrl.config.generate import GenerateConfig
from relayrl.data.build import build_prompt_data
from relayrl.data.records import PromptSample
from relayrl.models.loading import load_tokenizer, resolve_device
from relayrl.rollout import ENGINES
from relayrl.rollout.base import EngineSettings, SamplingParams
from relayrl.rollout.build import build_engine, engine_capabilities
from relayrl.tasks import get_task
from relayrl.workers.builders import build_frozen


@dataclass(kw_only=True, slots=True)
class GenerateResult:
    """What `run_generate` returns (the summary line's numbers and the written rows)."""

    output: Path
    """The JSONL file written."""
    rows: list[dict[str, Any]]
    """The rows written, in file order."""
    prompts: int
    """Prompts sampled."""
    samples: int
    """Samples generated (prompts x n_samples)."""
    scored: int
    """Samples with a valid reward (0 without a reward source)."""
    failed: int
    """FAILED samples (reward errors, and prompts too long for rollout.max_len)."""
    failures: dict[str, int]
    """FAILED samples by kind (exception, nan, bad_output, wrong_length, timeout, prompt_too_long, ...)."""
    empty: int
    """Samples with an empty response (never written)."""
    kept: int
    """Rows written."""
    ties: int
    """pairs: prompts skipped because their best and worst reward are equal (or fewer than two scored)."""
    new_tokens: int
    """Tokens generated."""
    seconds: float
    """Wall time of generation (engine start-up, loading and scoring excluded)."""

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else 0.0

    def summary(self, select: str) -> str:
        kinds = ", ".join(f"{k} {v}" for k, v in sorted(self.failures.items()))
        ties = f" ({self.ties} prompts tied)" if select == "pairs" else ""
        return (
            f"relayrl generate: {self.prompts} prompts, {self.samples} samples, {self.scored} scored, "
            f"{self.failed} failed{f' ({kinds})' if kinds else ''}, {self.kept} kept [{select}]{ties}, "
            f"{self.tokens_per_s:.1f} tokens/s; written to {self.output}"
        )


# ---------------------------------------------------------------------------------------------- validation
def reward_spec_of(cfg: GenerateConfig) -> str:
    """The reward source spec: reward.source, else task:<task.name>, else "" (no scoring)."""
    return resolve_reward_spec(cfg.reward.source, task=cfg.task.name)


def validate_generate_config(cfg: GenerateConfig, *, model_given: bool = False) -> None:
    """ConfigError (naming the field and the fix) for settings that cannot run; ConfigWarning for settings
    that have no effect in this command. Runs before anything is loaded (`model_given`: the caller passes
    the model, so model.name_or_path may be empty)."""

    r = cfg.rollout

    def bad(name: str, message: str) -> ConfigError:
        return ConfigError(f"{name}: {message}", field=name)

    if not cfg.model.name_or_path and not model_given:
        raise bad("model.name_or_path", "required: a local model folder or Hub id")
    if not cfg.output:
        raise bad("output", "required: the JSONL file to write (--output samples.jsonl)")
    if not cfg.task.name and not cfg.data.datasets:
        raise bad("data.datasets", "no prompts: set --data.datasets FILE... or --task.name (e.g. add2)")
    clash = _input_at(Path(cfg.output), cfg)
    if clash is not None:
        raise bad(
            "output",
            f"{cfg.output} is also an input ({clash}); writing it would replace what the run reads: choose "
            "another --output",
        )
    if r.engine not in ENGINES:
        raise bad("rollout.engine", f"{r.engine!r} is not known; choose one of {', '.join(ENGINES)}")
    if r.agent != "single":
        raise bad("rollout.agent", f"{r.agent!r}: generate samples single-turn completions; use single")
    for name in ("n_samples", "max_new_tokens", "max_len", "prompts_per_step"):
        if getattr(r, name) < 1:
            raise bad(f"rollout.{name}", f"{getattr(r, name)} is invalid; expected an int >= 1")
    for name, ok, want in [
        ("engine_slots", r.engine_slots >= 0, "0 (auto) or an int >= 1"),
        ("temperature", r.temperature >= 0, "a float >= 0 (0 = greedy)"),
        ("top_p", 0 < r.top_p <= 1, "a float in (0, 1]"),
    ]:
        if not ok:
            raise bad(f"rollout.{name}", f"{getattr(r, name)} is invalid; expected {want}")
    spec = reward_spec_of(cfg)
    if spec == "agent":
        raise bad("reward.source", "'agent' rewards come from multi-turn agents; give a reward source")
    if cfg.select != "all" and not spec:
        raise bad("select", f"{cfg.select!r} ranks samples by reward: set --reward.source or --task.name")
    if cfg.select == "pairs" and r.n_samples < 2:
        raise bad("rollout.n_samples", "pairs compares a prompt's samples: use >= 2")
    _warn_ineffective(cfg)


def _input_at(output: Path, cfg: GenerateConfig) -> str | None:
    """The input field that `output` would overwrite (a prompt file, a file of a prompt folder, the reward
    file), or None."""
    inputs: list[tuple[str, Path]] = []
    for i, source in enumerate(cfg.data.datasets):
        path = Path(source).expanduser()
        inputs.append((f"data.datasets[{i}]", path))
        if path.is_dir():
            inputs += [
                (f"data.datasets[{i}] (a file of the folder)", f) for f in path.iterdir() if f.is_file()
            ]
    if cfg.reward.source:
        inputs.append(("reward.source", Path(cfg.reward.source).expanduser()))
    out = output.expanduser().resolve()
    return next((name for name, path in inputs if path.resolve() == out), None)


def _changed(obj: Any, default: Any, names: tuple[str, ...], prefix: str) -> list[str]:
    return [f"{prefix}{n}" for n in names if getattr(obj, n) != getattr(default, n)]


def _warn_ineffective(cfg: GenerateConfig) -> None:
    d = GenerateConfig()
    shaping = ("clip", "overlong_buffer", "overlong_penalty", "truncation_penalty", "normalize")
    checks = [
        (_changed(cfg.reward, d.reward, shaping, "reward."), True, "generate writes raw rewards"),
        (
            _changed(cfg.rollout, d.rollout, ("agent_file", "max_turns", "failure_policy"), "rollout."),
            True,
            "generate samples single-turn completions; failed samples are counted and never selected",
        ),
        (
            _changed(cfg.data, d.data, ("eval_dataset", "eval_split_ratio"), "data."),
            not cfg.task.name,
            "generate samples the training sources (eval_split_ratio removes prompts from them)",
        ),
        (_changed(cfg.task, d.task, ("eval_rows",), "task."), True, "generate samples task.train_rows"),
        (
            _changed(cfg, d, ("threshold", "max_per_prompt"), ""),
            cfg.select != "rejection",
            f"select={cfg.select!r}",
        ),
        (
            _changed(cfg, d, ("condition_template",), ""),
            cfg.select != "conditional",
            f"select={cfg.select!r}",
        ),
    ]
    for names, ineffective, why in checks:
        if names and ineffective:
            warnings.warn(f"{', '.join(names)} has no effect: {why}", ConfigWarning, stacklevel=3)


# ---------------------------------------------------------------------------------------------- stages
def build_prompts(cfg: GenerateConfig, tokenizer: Any) -> list[PromptSample]:
    """The prompts: data.datasets through build_prompt_data, or the task's train rows written to a
    temporary JSONL and read through the same loader (so templating is identical)."""

    if not cfg.task.name:
        return build_prompt_data(cfg.data, tokenizer)[0]
    rows = get_task(cfg.task.name).make_rows("train", cfg.task.train_rows, cfg.data.seed)
    with tempfile.TemporaryDirectory(prefix="relayrl-generate-") as tmp:
        path = Path(tmp) / f"{cfg.task.name}.jsonl"
        path.write_text("".join(json.dumps({**row, "datasource": cfg.task.name}) + "\n" for row in rows))
        data = replace(
            cfg.data,
            datasets=[str(path)],
            dataset_probs=[],
            eval_dataset=None,
            eval_split_ratio=0.0,
            datasource_key="datasource",
        )
        return build_prompt_data(data, tokenizer)[0]


def prompt_seed(seed: int, index: int) -> int:
    """The request seed of prompt `index` (the RL policy's rule: a prompt's samples depend on it alone)."""
    return (seed * 1_000_003 + index * 7919) % (2**31)


def sample_groups(
    cfg: GenerateConfig, model: Any, tokenizer: Any, prompts: list[PromptSample], log: Any
) -> tuple[list[list[Trajectory]], float]:
    """n trajectories per prompt (one group per prompt, in prompt order) and the generation seconds."""
    import torch

    r = cfg.rollout
    # an engine with fixed slots is sized to the prompts in flight; others (vllm) size their batch themselves
    slots = r.engine_slots or min(len(prompts), r.prompts_per_step) * r.n_samples
    fixed = engine_capabilities(r.engine).fixed_slots
    settings = EngineSettings(
        max_seq_len=r.max_len,
        max_seqs=slots if fixed else None,
        gpu_util=r.vllm_gpu_util,
        any_version=r.vllm_any_version,
        fused_kernels=r.fused_kernels,
    )
    engine = build_engine(r.engine, model, tokenizer, settings)
    executor = SingleTurnExecutor(engine, tokenizer, max_total_len=r.max_len, log=log)
    base = SamplingParams(
        n=r.n_samples,
        temperature=r.temperature,
        top_p=r.top_p,
        top_k=r.top_k,
        max_new_tokens=r.max_new_tokens,
    )

    async def run() -> list[list[Trajectory]]:
        jobs = [executor.execute(s, replace(base, seed=prompt_seed(cfg.seed, s.index))) for s in prompts]
        return list(await asyncio.gather(*jobs))

    try:
        t0 = time.perf_counter()
        with torch.no_grad():
            groups = asyncio.run(run())
        return groups, time.perf_counter() - t0
    finally:
        engine.close()


def build_scorer(cfg: GenerateConfig, tokenizer: Any, log: Any, device: str) -> Any:
    """The reward source of `reward_spec_of(cfg)`, or None. A reward_func file gets batches of one prompt's
    n samples, so its raise fails that prompt only."""
    spec = reward_spec_of(cfg)
    if not spec:
        return None
    parsed = parse_reward_spec(spec)
    if parsed.kind == "task":
        return build_reward_source(parsed, get_task=get_task, log=log)
    opts: dict[str, Any] = {"log": log}
    if parsed.kind in ("rm", "prm"):
        opts["device"] = device
    else:
        opts["timeout"] = cfg.reward.timeout_s
    if parsed.kind == "file":
        opts["batch_size"] = cfg.rollout.n_samples
    return build_reward_source(parsed, tokenizer=tokenizer, **opts)


def score_groups(source: Any, groups: list[list[Trajectory]], prompts_per_call: int) -> None:
    """Fill rewards in place, `prompts_per_call` prompts' samples per `source.score` call (bounds how many
    reward calls run at once)."""

    async def run() -> None:
        for i in range(0, len(groups), prompts_per_call):
            await source.score([t for g in groups[i : i + prompts_per_call] for t in g])

    asyncio.run(run())


# ---------------------------------------------------------------------------------------------- run
def check_output_writable(path: Path) -> None:
    """Fail before any generation when `path` could not be written at the end: it is a folder, or its nearest
    existing parent folder is a file or not writable (nothing is created here)."""
    if path.is_dir():
        raise IsADirectoryError(
            f"--output {path} is a folder; give a file path (e.g. {path / 'samples.jsonl'})"
        )
    parent = next(p for p in (path.parent.absolute(), *path.parent.absolute().parents) if p.exists())
    if not parent.is_dir():
        raise NotADirectoryError(f"--output {path} cannot be written: {parent} is a file, not a folder")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise PermissionError(f"--output {path} cannot be written: no write permission in {parent}")


def write_jsonl_atomic(path: Path, rows: list[dict[str, Any]]) -> Path:
    """Write rows as JSONL to a temporary file in the same folder, then rename it over `path`: readers see
    the old file or the whole new one, never a partial one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with tmp.open("w") as f:
            f.writelines(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def _load(cfg: GenerateConfig, device: Any) -> Any:
    """The model the engine runs: a path for an engine that loads its own weights (vllm), else a frozen causal
    LM."""
    if engine_capabilities(cfg.rollout.engine).own_weights:
        return cfg.model.name_or_path
    return build_frozen(cfg.model, device)


def run_generate(cfg: GenerateConfig, *, model: Any = None, tokenizer: Any = None) -> GenerateResult:
    """Sample, score, select and write per `cfg` (module doc). `model` / `tokenizer`: use these (e.g. the
    policy of an iterative-DPO loop, in eval mode; a path for the vllm engine) instead of loading
    model.name_or_path."""

    # no global reseeding: every request carries its own seed, and an in-process caller keeps its RNG state
    validate_generate_config(cfg, model_given=model is not None and tokenizer is not None)
    check_output_writable(Path(cfg.output))
    device = resolve_device(cfg.device)
    m = cfg.model
    if tokenizer is None:
        tokenizer = load_tokenizer(
            m.tokenizer_name_or_path or m.name_or_path, trust_remote_code=m.trust_remote_code
        )
    log = FailureLog()
    scorer = build_scorer(cfg, tokenizer, log, str(device))  # a bad reward spec fails before generating
    prompts = build_prompts(cfg, tokenizer)
    groups, seconds = sample_groups(
        cfg, model if model is not None else _load(cfg, device), tokenizer, prompts, log
    )
    if scorer is not None:
        score_groups(scorer, groups, cfg.rollout.prompts_per_step)
    opts = SelectOptions(
        scored=scorer is not None,
        threshold=cfg.threshold,
        max_per_prompt=cfg.max_per_prompt,
        template=cfg.condition_template,
        tokenizer=tokenizer,
    )
    chosen = SELECTORS[cfg.select](groups, opts)
    output = write_jsonl_atomic(Path(cfg.output), chosen.rows)
    save_yaml(cfg, output.with_suffix(".config.yaml"))
    trajs = [t for g in groups for t in g]
    failed = [t for t in trajs if t.status != TrajectoryStatus.OK]
    return GenerateResult(
        output=output,
        rows=chosen.rows,
        prompts=len(groups),
        samples=len(trajs),
        scored=sum(t.reward is not None for t in trajs),
        failed=len(failed),
        failures=dict(Counter(t.failure_kind or "unknown" for t in failed)),
        empty=sum(not t.response_text.strip() for t in trajs),
        kept=len(chosen.rows),
        ties=chosen.ties,
        new_tokens=sum(t.response_len for t in trajs),
        seconds=seconds,
    )


def main(argv: list[str] | None = None) -> int:
    """`relayrl generate --model.name_or_path PATH (--data.datasets F | --task.name T) --output OUT.jsonl`."""

    def go(cfg: GenerateConfig) -> int:
        result = run_generate(cfg)
        print(result.summary(cfg.select), flush=True)
        return 0

    return run_command(
        GenerateConfig, argv, "relayrl generate", go, description=(__doc__ or "").split("\n\n")[0]
    )


if __name__ == "__main__":
    raise SystemExit(main())
