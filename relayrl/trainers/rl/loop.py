"""`relayrl rl`: the single-controller RL loop (PPO / REINFORCE++ / GRPO / RLOO / Dr. GRPO / GSPO / CISPO).

One step, in one sitting (`RLTrainer.train_step`):

    rollout()          prompts (resumable sampler) -> policy.rollout (agent executor on the colocated engine,
                       n samples per prompt) -> reward.score -> failure policy -> dynamic filtering, refilled
                       from new prompts up to filter.max_refills times            -> list[Trajectory]
    make_experience()  collate -> old log-probs (policy) | ref log-probs (reference) | values (critic), in
                       parallel -> shaped rewards -> KL -> ADVANTAGES[algo.advantage]  -> Experience
    update()           policy.update (epochs x mini-batches x packed token-budget micro-batches, loss over the
                       optimizer step's global denominator) | critic.update; KL controller update
    sync()             policy.sync: the colocated engine reads the new weights in place (load_weights(None))
    log()              metrics.jsonl / TensorBoard / W&B, progress line, sample table; eval every k steps;
                       checkpoint every ckpt.save_every steps

Roles are `RoleHandle`s from relayrl.distributed.launch: plain objects (`dist.mode=local`) or Ray actors
(`dist.mode=ray`), the same worker classes either way. Rollout seeds derive from (train.seed, step, attempt,
prompt index), so a resumed run samples exactly what an uninterrupted one would have (exact resume).

Run folder (train.output_dir, default runs/rl): config.yaml, data/ (task rows), metrics.jsonl, samples.jsonl,
tensorboard/, checkpoints/step_<N>/{policy,critic}/ (HF folders + worker_state.pt), curves.png, final/ (HF).
Exit codes: 0 done, 1 stopped on an error (message printed), 2 bad config, 130 / 143 interrupted by
SIGINT / SIGTERM after writing a checkpoint.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from relayrl.agents.base import Trajectory
from relayrl.config.rl import ResolvedRL, RLConfig
from relayrl.data.records import PromptSample
from relayrl.trainers.rl.support import (
    SignalFlag,
    Timer,
    add,
    as_dict,
    checkpoint_manager,
    due,
    failure_counts,
    reward_norm,
)
from relayrl.workers.base import Experience, collate
from relayrl.workers.trained import WorkerFolder

log = logging.getLogger("relayrl.rl")

MAX_SKIPPED_STEPS = 3
"""Consecutive steps with nothing to train (all failed / all filtered) before the run stops with exit 1."""


@dataclass(kw_only=True)
class RLResult:
    """What `run_rl` returns."""

    run_dir: Path
    """The run folder."""
    steps: int
    """Steps completed (including those of a resumed run before this process)."""
    history: list[dict[str, float]] = field(default_factory=list)
    """Per-step metrics logged by this process."""
    eval: dict[str, float] = field(default_factory=dict)
    """The last eval metrics (eval/*), empty when eval is off."""
    first_eval: dict[str, float] = field(default_factory=dict)
    """The eval metrics before the first update (step 0), when eval is on and the run started fresh."""
    final_model: Path | None = None
    """HF folder of the final policy (None when stopped early)."""
    exit_code: int = 0
    """0 done, 1 error, 130 / 143 interrupted."""
    message: str = ""
    """Why the run stopped early, if it did."""
    already_complete: bool = False
    """The run folder's checkpoint had already reached train.max_steps: nothing was trained."""


def _filter_fractions(counts: dict[str, float]) -> dict[str, float]:
    """Per-round fractions summed over refill rounds -> fractions of every group generated this step (<= 1):
    filter/zero_var_frac and filter/out_of_range_frac from the summed group counts; filter/refills = rounds - 1."""
    out = dict(counts)
    seen = out.get("filter/groups_kept", 0.0) + out.get("filter/groups_dropped", 0.0)
    for what in ("zero_var", "out_of_range"):
        if f"filter/{what}_frac" in out:
            out[f"filter/{what}_frac"] = out.get(f"filter/groups_{what}", 0.0) / max(seen, 1.0)
    if "filter/rounds" in out:
        out["filter/refills"] = out["filter/rounds"] - 1.0
    return out


class _Skip(Exception):
    """Nothing to train this step (every trajectory failed or every group was filtered)."""


class RLTrainer:
    """Builds the run (config check, prompts, roles, logger, checkpoints) and runs the loop."""

    def __init__(self, cfg: RLConfig, *, banner: bool = True) -> None:
        from relayrl.config.base import save_yaml
        from relayrl.models.loading import load_tokenizer, resolve_source
        from relayrl.trainers.rl.prompts import build_prompts, check_labels
        from relayrl.trainers.rl.roles import build_kl_controller, build_roles
        from relayrl.trainers.rl.validate import validate_rl
        from relayrl.training.sampler import ResumableSampler
        from relayrl.training.setup import check_config_change, prepare_run_dir
        from relayrl.workers.builders import exact_on_policy, setup_process

        cfg = validate_rl(cfg)
        self.cfg = cfg
        self.run_dir = prepare_run_dir(Path(cfg.train.output_dir or "runs/rl"), cfg.ckpt, "relayrl rl")
        a = cfg.algo  # the policy's schedule spans max_steps x epochs x mini_batches optimizer steps
        check_config_change(self.run_dir, cfg, "relayrl rl", updates_per_step=a.epochs * a.mini_batches)
        save_yaml(cfg, self.run_dir / "config.yaml")
        setup_process(cfg.train.seed)
        m = cfg.model
        resolve_source(m.name_or_path)  # a missing path fails here, naming model.name_or_path
        tokenizer = load_tokenizer(
            m.tokenizer_name_or_path or m.name_or_path, trust_remote_code=m.trust_remote_code
        )
        self.tokenizer = tokenizer
        self.prompts = build_prompts(cfg, self.run_dir, tokenizer)
        check_labels(cfg, self.prompts)
        if cfg.train.max_steps == 0:  # one pass over the training prompts
            steps = -(-len(self.prompts.train) // cfg.rollout.prompts_per_step)
            cfg = self.cfg = ResolvedRL(replace(cfg, train=replace(cfg.train, max_steps=steps)))
            print(
                f"relayrl rl: train.max_steps 0 = one pass over the {len(self.prompts.train)} training prompts: "
                f"{steps} steps of {cfg.rollout.prompts_per_step} prompts"
            )
        self.sampler = ResumableSampler(len(self.prompts.train), 1, seed=cfg.train.seed, shuffle=True)
        self.kl_ctl = build_kl_controller(cfg)
        self.reward_norm = reward_norm(cfg)
        self.step = 0
        self.skipped = 0
        self.version = 0
        """The policy version the engine holds: the step of the last weight sync (async staleness counts it)."""
        self._async: Any = None
        """train.async_train: the rollout pipeline (rl_async.AsyncRollout), once the loop starts."""
        self.roles = build_roles(cfg, cfg.train.max_steps)
        info = self.roles.policy.call("info")
        self.pad_id = int(info["pad_id"])
        self.on_policy = exact_on_policy(cfg.algo)
        a = self.cfg.algo
        print_banner = print if banner else (lambda *args, **kwargs: None)
        print_banner(
            f"relayrl rl: {a.preset or 'custom'} (advantage {a.advantage}, loss {a.policy_loss}, kl {a.kl_mode}) on "
            f"{cfg.model.name_or_path} ({info['params'] / 1e6:.1f}M params, {info['precision']}, "
            f"{info['layout']} attention, engine {cfg.rollout.engine} on {info['engine_weights']} weights), "
            f"{info.get('ranks', 1)} policy rank(s), {cfg.train.max_steps} steps of {cfg.rollout.prompts_per_step} "
            f"x {cfg.rollout.n_samples} samples, old-log-prob pass "
            f"{'skipped (exactly on-policy)' if self.on_policy else 'on'}; run folder {self.run_dir}",
            flush=True,
        )
        self.ckpt = checkpoint_manager(cfg, self.run_dir)

    # =========================================================================================== the step
    def train_step(self) -> dict[str, float]:
        """One RL step (see module doc); returns its metrics. Raises _Skip when there is nothing to train."""
        timer = Timer()
        with timer("generation"):
            if self._async is not None:
                trajs, metrics = self._async.take(self.step, self.version)
            else:
                trajs, metrics = self.rollout()
        with timer("experience"):
            exp, m = self.make_experience(trajs)
        metrics.update(m)
        with timer("update"):
            metrics.update(self.update(exp, metrics.get("rollout/kl", 0.0)))
        with timer("sync"):
            metrics.update(self.sync())
        metrics.update(timer.metrics())
        tokens = float(exp.tokens.attention_mask.sum())
        metrics["perf/train_tokens_per_s"] = tokens / max(1e-9, timer.seconds["update"])
        gen_s = metrics.get(
            "timing/rollout_produce", timer.seconds["generation"]
        )  # async: the producer's time
        metrics["perf/gen_tokens_per_s"] = (
            metrics.get("rollout/response_len", 0.0) * len(trajs) / max(1e-9, gen_s)
        )
        self._last_trajs = trajs
        return metrics

    def rollout(self, step: int | None = None) -> tuple[list[Trajectory], dict[str, float]]:
        """Sample, score, apply the failure policy and dynamic filtering; refill dropped groups (bounded).
        `step`: the RL step the batch is for (seeds derive from it; default the current one)."""
        step = self.step if step is None else step
        from relayrl.agents.failures import RolloutFailure, apply_failure_policy
        from relayrl.trainers.rl.experience import complete_groups, filter_groups, rollout_metrics

        r, f = self.cfg.rollout, self.cfg.filter
        kept: list[Trajectory] = []
        counts: dict[str, float] = {}
        last_error = ""
        drawn: dict[int, int] = {}
        attempts = 1 + (f.max_refills if f.enabled else 0)
        for attempt in range(attempts):
            need = r.prompts_per_step - len(kept) // r.n_samples
            if need <= 0:
                break
            prompts = self._draw_prompts(need, drawn)
            trajs = self.roles.generator.call("rollout", prompts, self._seed(attempt, step))
            t0 = time.perf_counter()
            trajs = self.roles.reward.call("score", trajs)
            add(counts, {"rollout/generated": float(len(trajs)), "timing/reward": time.perf_counter() - t0})
            try:
                ok, m = apply_failure_policy(trajs, r.failure_policy)
            except RolloutFailure as e:
                ok, m, last_error = [], failure_counts(trajs), str(e)
            add(counts, m)
            ok = complete_groups(ok, r.n_samples) if r.failure_policy != "drop_sample" else ok
            if f.enabled:
                ok, m = filter_groups(ok, r.n_samples, f)
                add(counts, m)
            kept += ok
            counts["filter/rounds"] = float(attempt + 1)
        if not kept:
            raise _Skip(
                f"step {step}: nothing to train: {counts.get('rollout/failed', 0):.0f} of "
                f"{counts.get('rollout/generated', 0):.0f} samples failed, "
                f"{counts.get('filter/groups_dropped', 0):.0f} groups filtered out (filter.max_refills="
                f"{f.max_refills}); counts: {_filter_fractions(counts)}"
                + (f". Last error: {last_error}" if last_error else "")
            )
        return kept, {**_filter_fractions(counts), **rollout_metrics(kept)}

    def _draw_prompts(self, need: int, drawn: dict[int, int]) -> list[PromptSample]:
        """The next `need` prompts. A prompt drawn twice in one step (a dataset smaller than a step) gets a
        distinct index for its copy, so its groups stay apart (groups are keyed by index) and it is sampled
        with a different seed."""
        out = []
        size = len(self.prompts.train)
        for _ in range(need):
            sample = self.prompts.train[self.sampler.next_indices()[0]]
            k = drawn.get(sample.index, 0)
            drawn[sample.index] = k + 1
            out.append(sample if k == 0 else replace(sample, index=sample.index + k * size))
        return out

    def make_experience(self, trajs: list[Trajectory]) -> tuple[Experience, dict[str, float]]:
        """Old / reference log-probs and values (in parallel across roles), shaped rewards, advantages. The
        old-log-prob forward is skipped when the update is exactly on-policy (workers.builders.exact_on_policy)."""
        from relayrl.trainers.rl.experience import step_advantages, trajectory_rewards

        batch = collate(trajs, self.pad_id)
        rewards, metrics = trajectory_rewards(trajs, self.cfg, self.reward_norm)
        jobs = {}
        if not self.on_policy:
            jobs["old"] = self.roles.policy.submit("logprobs", batch)
        if self.roles.reference is not None:
            jobs["ref"] = self.roles.reference.submit("logprobs", batch)
        if self.roles.critic is not None:
            jobs["values"] = self.roles.critic.submit("values", batch)
        got = dict(zip(jobs, self.roles.launcher.wait(list(jobs.values())), strict=True))
        adv, ret, _, m = step_advantages(
            self.cfg,
            rewards=rewards,
            action_mask=batch.action_mask,
            old_logprobs=got.get("old", batch.rollout_logprobs),
            ref_logprobs=got.get("ref"),
            values=got.get("values"),
            kl_coef=self.kl_ctl.value,
        )
        metrics.update(m)
        if "old" in got:  # the engine's log-probs against the trainer's, before the update
            from relayrl.algorithms.off_policy import logprob_mismatch

            mm = logprob_mismatch(got["old"], batch.rollout_logprobs, batch.action_mask)
            metrics.update({f"mismatch/{k}": v for k, v in mm.items()})
        exp = Experience(
            tokens=batch,
            old_logprobs=got.get("old"),
            advantages=adv,
            rewards=rewards,
            ref_logprobs=got.get("ref"),
            values=got.get("values"),
            returns=ret if "values" in got else None,
        )
        return exp, metrics

    def update(self, exp: Experience, kl: float) -> dict[str, float]:
        """Policy and critic updates (in parallel across roles); then the KL controller."""
        jobs = [self.roles.policy.submit("update", exp, self.kl_ctl.value)]
        if self.roles.critic is not None:
            jobs.append(self.roles.critic.submit("update", exp))
        metrics: dict[str, float] = {"train/kl_coef": self.kl_ctl.value}
        for m in self.roles.launcher.wait(jobs):
            metrics.update(m)
        self.kl_ctl.update(kl, len(exp.rewards))
        return metrics

    def sync(self) -> dict[str, float]:
        """New weights to the engine as version `self.step` (an on-device cast-copy, nothing when it runs on
        the policy's own parameters, or streamed tensors); returns timing/engine_refresh. In async mode the
        engine's in-flight requests continue under the new weights (partial rollout)."""
        out = self.roles.sync_weights(self.step)
        self.version = self.step
        if self._async is not None:
            self._async.step_done(self.step)
        return out

    # =========================================================================================== async
    def _start_async(self) -> None:
        from relayrl.trainers.rl.async_rollout import AsyncRollout

        r = self.cfg.rollout
        self._async = AsyncRollout(
            self.rollout,
            self.sampler,
            skip=_Skip,
            first_step=self.step + 1,
            last_step=self.cfg.train.max_steps,
            max_staleness=self.cfg.train.max_staleness,
            steps_done=self.step,
            group_size=r.n_samples if r.failure_policy != "drop_sample" else None,
            gil_switch_s=self.cfg.train.gil_switch_s,
        )

    def _stop_async(self, timeout: float = 0) -> None:
        if self._async is not None:
            self._async.close(timeout)

    # =========================================================================================== eval
    def evaluate(self) -> dict[str, float]:
        """eval/* on the eval prompts (reward, pass@1, pass@k, per data source)."""
        from relayrl.trainers.rl.eval import eval_metrics

        if not self.prompts.eval:
            return {}
        t0 = time.perf_counter()
        trajs = self.roles.generator.call("rollout", self.prompts.eval, self.cfg.train.seed + 12345, True)
        trajs = self.roles.reward.call("score", trajs)
        e = self.cfg.eval
        metrics = eval_metrics(trajs, n_samples=e.n_samples, threshold=e.correct_threshold)
        metrics["timing/eval"] = time.perf_counter() - t0
        return metrics

    # =========================================================================================== loop
    def fit(self, on_step: Callable[[int, dict[str, float]], None] | None = None) -> RLResult:
        """Run to train.max_steps (resuming per ckpt.resume); SIGINT / SIGTERM finish the step, write a
        checkpoint and stop. `on_step(step, metrics)` is called after each logged step (hooks, tests)."""
        from relayrl.trainers.rl.report import RLProgress, plot_curves

        resumed = self.resume()
        self._start_step = self.step
        done_before = resumed and self.step >= self.cfg.train.max_steps
        logger = self._build_logger()
        bar = self.cfg.logger.progress_bar
        progress = RLProgress(self.cfg.train.max_steps, enabled=bar, print_every=1, start_step=self.step)
        result = RLResult(run_dir=self.run_dir, steps=self.step, already_complete=done_before)
        stop = SignalFlag()
        try:
            with stop.installed():
                if self.cfg.eval.every and not resumed:
                    result.first_eval = result.eval = self._eval_and_log(logger, progress)
                if self.cfg.train.async_train and not done_before:
                    self._start_async()
                self._loop(result, stop, logger, progress, on_step)
            self._stop_async()
            self._finish(result, stop)
        finally:
            self._stop_async()
            progress.close()
            logger.close()
            plot_curves(self.run_dir / "metrics.jsonl", self.run_dir / "curves.png")
            self.roles.close()  # aborts a batch still in flight
            self._stop_async(timeout=60)
        return result

    def _loop(self, result: RLResult, stop: SignalFlag, logger: Any, progress: Any, on_step: Any) -> None:
        """train_step -> eval (every k) -> log -> checkpoint (every n, or on a signal), until done."""
        from relayrl.trainers.rl.report import log_samples

        cfg = self.cfg
        while self.step < cfg.train.max_steps and stop.signum is None:
            metrics = self._one_step(result)
            if metrics is None:
                if self.skipped >= MAX_SKIPPED_STEPS:
                    return
                continue
            if due(cfg.eval.every, self.step) or (cfg.eval.every and self.step == cfg.train.max_steps):
                result.eval = self.evaluate()
                metrics.update(result.eval)
            logger.log(metrics, self.step)
            progress.update(self.step, metrics)
            result.history.append(metrics)
            if on_step is not None:
                on_step(self.step, metrics)
            table = cfg.logger.progress_bar and due(max(1, cfg.train.log_every), self.step)
            log_samples(self._last_trajs, self.step, self.run_dir, console=table, tokenizer=self.tokenizer)
            evaluated = cfg.ckpt.best_metric in metrics
            if (
                due(cfg.ckpt.save_every, self.step)
                or stop.signum is not None
                or (cfg.ckpt.keep_best and evaluated)
            ):
                # with keep_best every eval step is also a save step, so the best checkpoint is always ranked
                self.save_checkpoint(metrics)

    def _finish(self, result: RLResult, stop: SignalFlag) -> None:
        """Exit code and message; on success the last checkpoint and the final HF model."""
        result.steps = self.step
        if stop.signum is not None:
            result.exit_code, result.message = 128 + stop.signum, f"interrupted by signal {stop.signum}"
            print(f"relayrl rl: {result.message}; checkpoint written at step {self.step}", file=sys.stderr)
        elif self.skipped >= MAX_SKIPPED_STEPS:
            result.exit_code = 1
        elif not result.history and self.step > self._start_step:
            # every step of this run was skipped (fewer than MAX_SKIPPED_STEPS of them): the "final model"
            # would be the starting one; say so instead of exporting it as a result
            result.exit_code = 1
            result.message = (
                f"no update was made: all {self.step - self._start_step} step(s) of this run were skipped "
                f"(last: {result.message or 'nothing to train'}); the model is unchanged, no final model written"
            )
        else:
            latest = self.ckpt.latest()
            if latest is None or latest.name != f"step_{self.step}":
                self.save_checkpoint(result.history[-1] if result.history else {})
            result.final_model = Path(self.roles.policy.call("export", str(self.run_dir / "final")))

    def _build_logger(self) -> Any:
        from relayrl.trainers.rl.report import SAMPLES_FILE
        from relayrl.training.logging import MetricsLogger, keep_rows_up_to

        lg = self.cfg.logger
        # a resumed run replays the steps after its checkpoint: their samples (like their metrics) go
        keep_rows_up_to(self.run_dir / SAMPLES_FILE, self.step)
        return MetricsLogger(
            self.run_dir,
            total_steps=self.cfg.train.max_steps,
            tensorboard=lg.tensorboard,
            wandb=lg.wandb,
            wandb_project=lg.wandb_project,
            wandb_run_name=lg.wandb_run_name or self.run_dir.name,
            config=as_dict(self.cfg),
            console=False,
            start_step=self.step,
        )

    def _one_step(self, result: RLResult) -> dict[str, float] | None:
        """train_step with the skip rule: a step with nothing to train is counted, logged, and skipped."""
        t0 = time.perf_counter()
        self.step += 1
        try:
            metrics = self.train_step()
        except _Skip as e:
            if self._async is not None:
                # the weights did not change, but the version must follow the step: the producer's gate and
                # the staleness bound both count steps (an unsynced skip would let the next batches start a
                # version early, be dropped as stale, and skip every other step from then on)
                self.sync()
            self.skipped += 1
            msg = f"{e} [{self.skipped} consecutive skipped step(s); stopping after {MAX_SKIPPED_STEPS}]"
            print(f"relayrl rl: warning: {msg}", file=sys.stderr, flush=True)
            result.message = msg
            return None
        self.skipped = 0
        metrics["timing/step"] = time.perf_counter() - t0
        metrics["train/step"] = float(self.step)
        return metrics

    def _eval_and_log(self, logger: Any, progress: Any) -> dict[str, float]:
        metrics = self.evaluate()
        if metrics:
            logger.log(metrics, self.step)
            progress.update(self.step, metrics)
        return metrics

    def _seed(self, attempt: int, step: int) -> int:
        return (self.cfg.train.seed * 1_000_003 + step * 1009 + attempt) % (2**31)

    # =========================================================================================== checkpoints
    def save_checkpoint(self, metrics: dict[str, float]) -> Path:
        """policy/ (+ critic/) folders, controller state (sampler, KL controller, reward norm, counters), RNG."""
        models = {"policy": WorkerFolder(self.roles.policy)}
        if self.roles.critic is not None:
            models["critic"] = WorkerFolder(self.roles.critic)
        metric = metrics.get(self.cfg.ckpt.best_metric)
        extra = {  # async: the sampler as after this step's batch (the producer may have drawn further)
            "sampler": self._async.sampler_state if self._async is not None else self.sampler.state_dict(),
            "kl": self.kl_ctl.state_dict(),
            "reward_norm": self.reward_norm.state_dict() if self.reward_norm is not None else None,
        }
        state = {"skipped": self.skipped, "total_steps": self.cfg.train.max_steps}
        return self.ckpt.save(self.step, models=models, trainer_state=state, extra=extra, metric=metric)

    def resume(self) -> bool:
        """Restore per ckpt.resume (auto: the run folder's latest, none, or a path); True when resumed."""
        r = self.cfg.ckpt.resume
        if r == "none":
            return False
        path = self.ckpt.resumable() if r == "auto" else Path(r)
        if path is None:
            return False
        if not (path / "trainer_state.json").is_file():
            raise FileNotFoundError(f"ckpt.resume={r!r} is not a checkpoint folder (no trainer_state.json)")
        loaded = self.ckpt.load(path)
        self.roles.policy.call("load", str(path / "policy"))
        self.roles.sync_weights(loaded.step)  # the engines start from the restored weights
        if self.roles.critic is not None:
            self.roles.critic.call("load", str(path / "critic"))
        self.sampler.load_state_dict(loaded.extra["sampler"])
        self.kl_ctl.load_state_dict(loaded.extra["kl"])
        if self.reward_norm is not None and loaded.extra.get("reward_norm"):
            self.reward_norm.load_state_dict(loaded.extra["reward_norm"])
        self.step = self.version = loaded.step
        self.skipped = int(loaded.trainer_state.get("skipped", 0))
        print(f"relayrl rl: resumed from {path} (step {self.step})", flush=True)
        return True


def run_rl(cfg: RLConfig) -> RLResult:
    """Programmatic entry: build and run; errors while building propagate (the CLI turns them into exit 1)."""
    torch.set_num_threads(max(1, min(torch.get_num_threads(), 2 if cfg.train.device == "cpu" else 64)))
    return RLTrainer(cfg).fit()


def _run_cli(cfg: RLConfig) -> int:
    from relayrl.config.base import ConfigError

    try:
        result = run_rl(cfg)
    except ConfigError:
        raise
    except (FileNotFoundError, ValueError, OSError, RuntimeError) as e:
        print(f"relayrl rl: error: {e}", file=sys.stderr)
        return 1
    if result.exit_code == 0 and result.already_complete:
        print(
            f"relayrl rl: already complete at step {result.steps} (train.max_steps); raise --train.max_steps to "
            f"continue; final model in {result.final_model}"
        )
    elif result.exit_code == 0:
        acc = result.eval.get("eval/pass@1")
        print(
            f"relayrl rl: done, {result.steps} steps"
            + (f", eval pass@1 {acc:.3f}" if acc is not None else "")
        )
        print(f"relayrl rl: final model in {result.final_model}; curves in {result.run_dir / 'curves.png'}")
    elif result.message:
        print(f"relayrl rl: stopped: {result.message}", file=sys.stderr)
    return result.exit_code


def main(argv: list[str] | None = None) -> int:
    """`relayrl rl [--config run.yaml] [--section.field value ...]`."""
    from relayrl.config.base import ConfigError
    from relayrl.config.command_line import run_command

    def fn(cfg: RLConfig) -> int:
        try:
            return _run_cli(cfg)
        except ConfigError as e:
            print(f"relayrl rl: error: {e}", file=sys.stderr)
            return 2

    return run_command(RLConfig, argv, "relayrl rl", fn, description=__doc__.splitlines()[0])
