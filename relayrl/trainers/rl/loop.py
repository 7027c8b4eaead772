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

Where each piece lives: rollout() is relayrl.trainers.rl.rollout.RolloutPhase, taken through the rollout
strategy chosen at build time (relayrl.trainers.rl.async_rollout: SyncRollout, or AsyncRollout for
train.async_train); the roles (relayrl.trainers.rl.roles) are typed handles (`RoleHandle[PolicyWorker]`,
called as `policy.call(PolicyWorker.update, exp, kl_coef)`) over plain objects (`dist.mode=local`) or Ray
actors (`dist.mode=ray`), the same worker classes either way; the cadence rule, resume rule, checkpoint
manager and logger are relayrl.training's (loop.LoopSettings, setup.checkpoint_to_resume / build_*), shared
with the one-model recipes. Rollout seeds derive from (train.seed, step, attempt, prompt index), so a resumed
run samples exactly what an uninterrupted one would have (exact resume).

Run folder (train.output_dir, default runs/rl): config.yaml, data/ (task rows), metrics.jsonl, samples.jsonl,
tensorboard/, checkpoints/step_<N>/{policy,critic}/ (HF folders + worker_state.pt), curves.png, final/ (HF).
Exit codes: 0 done, 1 stopped on an error (message printed; also a run in which no step had a non-zero advantage:
nothing was learned, no final/ written), 2 bad config, 130 / 143 interrupted by SIGINT / SIGTERM after writing a
checkpoint.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from relayrl.agents.base import Trajectory
from relayrl.algorithms.off_policy import logprob_mismatch
from relayrl.config.base import ConfigError, to_dict
from relayrl.config.command_line import run_command
from relayrl.config.rl import RLConfig
from relayrl.trainers.rl.async_rollout import build_rollout_strategy
from relayrl.trainers.rl.eval import evaluate
from relayrl.trainers.rl.experience import distill_and_dense, step_advantages, trajectory_rewards
from relayrl.trainers.rl.report import SAMPLES_FILE, RLProgress, Timer, banner_text, log_samples, plot_curves
from relayrl.trainers.rl.roles import build_kl_controller, build_reward_norm, build_roles
from relayrl.trainers.rl.rollout import NothingToTrain, RolloutPhase
from relayrl.trainers.rl.setup import driver_threads, prepare_run
from relayrl.training.checkpoint import timed_write
from relayrl.training.logging import MetricsLogger, keep_rows_up_to
from relayrl.training.loop import LoopSettings, due
from relayrl.training.sampler import ResumableSampler, batches_drawn
from relayrl.training.setup import (
    build_checkpoint_manager,
    build_logger,
    checkpoint_to_resume,
    release_run_dir,
)
from relayrl.training.signals import SignalFlag
from relayrl.workers.base import Experience, collate
from relayrl.workers.builders import exact_on_policy
from relayrl.workers.critic import CriticWorker
from relayrl.workers.policy import PolicyWorker
from relayrl.workers.proxies import Generates, WorkerFolder
from relayrl.workers.reference import ReferenceWorker
from relayrl.workers.reward import score_trajectories

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


def settings_of(cfg: RLConfig) -> LoopSettings:
    """The loop's cadence: eval every eval.every steps and after the last (eval.every 0: never), checkpoints
    every ckpt.save_every steps (the final one is written by `_finish`), the sample table every log_every."""
    return LoopSettings(
        total_steps=cfg.train.max_steps,
        eval_every=cfg.eval.every,
        eval_final=cfg.eval.every != 0,
        save_every=cfg.ckpt.save_every,
        save_final=False,
        best_metric=cfg.ckpt.best_metric,
        log_every=max(1, cfg.train.log_every),
    )


class RLTrainer:
    """Builds the run (config check, prompts, roles, logger, checkpoints) and runs the loop."""

    def __init__(self, cfg: RLConfig, *, banner: bool = True) -> None:
        run = prepare_run(cfg)
        self.cfg = cfg = run.cfg
        self.run_dir, self.tokenizer, self.prompts = run.run_dir, run.tokenizer, run.prompts
        self.settings = settings_of(cfg)
        self.sampler = ResumableSampler(len(self.prompts.train), 1, seed=cfg.train.seed, shuffle=True)
        self.kl_ctl = build_kl_controller(cfg.algo)
        self.reward_norm = build_reward_norm(cfg.reward)
        self.step = 0
        self.skipped = 0
        self.learned = False
        """Whether any step so far had a non-zero advantage on an action token (else the run learned nothing)."""
        self.version = 0
        """The policy version the engine holds: the step of the last weight sync (async staleness counts it)."""
        self.rollouts = build_rollout_strategy(cfg.train, cfg.rollout)
        """Sync, or async (the next steps' rollout overlaps this step's update): chosen here, once."""
        self.roles = build_roles(
            cfg,
            cfg.train.max_steps,
            concurrency=self.rollouts.concurrency,
            overlaps=self.rollouts.overlaps,
            run_dir=self.run_dir,
        )
        self.rollout = RolloutPhase(
            generator=self.roles.generator,
            reward=self.roles.reward,
            prompts=self.prompts.train,
            sampler=self.sampler,
            rollout=cfg.rollout,
            filter=cfg.filter,
            seed=cfg.train.seed,
        )
        """rollout(step) -> (trajectories, metrics): the rollout phase the strategy takes batches from."""
        info = self.roles.policy.call(PolicyWorker.info)
        self.pad_id = int(info["pad_id"])
        self.on_policy = exact_on_policy(cfg.algo)
        if banner:
            print(banner_text(cfg, info, self.run_dir, self.on_policy), flush=True)
        self.ckpt = build_checkpoint_manager(
            cfg.ckpt, self.run_dir, hf_format=True
        )  # workers write HF folders
        self._last_trajs: list[Trajectory] = []

    # =========================================================================================== the step
    def train_step(self) -> dict[str, float]:
        """One RL step (see module doc); returns its metrics. Raises NothingToTrain when there is nothing to
        train."""
        timer = Timer()
        with timer("generation"):
            trajs, metrics = self.rollouts.take(self.step, self.version)
        with timer("experience"):
            exp, m = self.make_experience(trajs)
        metrics.update(m)
        with timer("update"):
            metrics.update(self.update(exp, metrics.get("rollout/kl", 0.0)))
        with timer("sync"):
            metrics.update(self.sync())
        metrics.update(timer.metrics() | self.roles.transfer_metrics())  # Ray: + timing/rows_put
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

    def make_experience(self, trajs: list[Trajectory]) -> tuple[Experience, dict[str, float]]:
        """Old / reference log-probs and values (in parallel across roles), shaped rewards, advantages. The
        old-log-prob forward is skipped when the update is exactly on-policy (workers.builders.exact_on_policy)."""
        batch = collate(trajs, self.pad_id)
        rewards, metrics = trajectory_rewards(trajs, self.cfg, self.reward_norm)
        r = self.roles
        rows = r.rows(batch)  # on Ray: put once, each rank fetches its share
        old = None if self.on_policy else r.policy.submit(PolicyWorker.logprobs, rows)
        ref = None if r.reference is None else r.reference.submit(ReferenceWorker.logprobs, rows)
        teacher = None if r.teacher is None else r.teacher.submit(ReferenceWorker.logprobs, rows)
        values = None if r.critic is None else r.critic.submit(CriticWorker.values, rows)
        old_lp = old.result() if old is not None else None
        ref_lp = ref.result() if ref is not None else None
        values_t = values.result() if values is not None else None
        student_lp = old_lp if old_lp is not None else batch.rollout_logprobs
        teacher_lp = teacher.result() if teacher is not None else None
        rewards, dense, m = distill_and_dense(trajs, self.cfg, batch, rewards, student_lp, teacher_lp)
        metrics.update(m)
        adv, ret, _, m = step_advantages(
            self.cfg,
            rewards=rewards,
            action_mask=batch.action_mask,
            old_logprobs=student_lp,
            ref_logprobs=ref_lp,
            values=values_t,
            kl_coef=self.kl_ctl.value,
            dense=dense,
        )
        metrics.update(m)
        self.learned = self.learned or bool((adv[batch.action_mask.bool()] != 0).any())
        if old_lp is not None:  # the engine's log-probs against the trainer's, before the update
            mm = logprob_mismatch(old_lp, batch.rollout_logprobs, batch.action_mask)
            metrics.update({f"mismatch/{k}": v for k, v in mm.items()})
        exp = Experience(
            tokens=batch,
            old_logprobs=old_lp,
            advantages=adv,
            rewards=rewards,
            ref_logprobs=ref_lp,
            values=values_t,
            returns=ret if values_t is not None else None,
        )
        return exp, metrics

    def update(self, exp: Experience, kl: float) -> dict[str, float]:
        """Policy and critic updates (in parallel across roles); then the KL controller."""
        rows = self.roles.rows(
            exp
        )  # on Ray: only the rows' new fields are put; the tokens were, for make_experience
        jobs = [self.roles.policy.submit(PolicyWorker.update, rows, self.kl_ctl.value)]
        if self.roles.critic is not None:
            jobs.append(self.roles.critic.submit(CriticWorker.update, rows))
        metrics: dict[str, float] = {"train/kl_coef": self.kl_ctl.value}
        for job in jobs:
            metrics.update(job.result())
        self.kl_ctl.update(kl, len(exp.rewards))
        return metrics

    def sync(self) -> dict[str, float]:
        """New weights to the engine as version `self.step` (an on-device cast-copy, nothing when it runs on
        the policy's own parameters, or streamed tensors); returns timing/engine_refresh. In async mode the
        engine's in-flight requests continue under the new weights (partial rollout)."""
        out = self.roles.sync_weights(self.step)
        self.version = self.step
        self.rollouts.step_done(self.step)
        return out

    def evaluate(self) -> dict[str, float]:
        """eval/* on the eval prompts (reward, pass@1, pass@k, per data source)."""
        if not self.prompts.eval:
            return {}
        gen, reward = self.roles.generator, self.roles.reward
        return evaluate(
            lambda prompts, seed, ev: gen.call(Generates.rollout, prompts, seed, ev),
            lambda trajs: score_trajectories(reward, trajs),
            self.prompts.eval,
            seed=self.cfg.train.seed,
            eval=self.cfg.eval,
        )

    # =========================================================================================== loop
    def fit(self, on_step: Callable[[int, dict[str, float]], None] | None = None) -> RLResult:
        """Run to train.max_steps (resuming per ckpt.resume); SIGINT / SIGTERM finish the step, write a
        checkpoint and stop. `on_step(step, metrics)` is called after each logged step (hooks, tests)."""
        try:
            resumed = self.resume()
        except BaseException:
            # a refused checkpoint must not leave the roles (Ray actors, engine processes) or the run-folder
            # lock behind: the loop's own `finally` below has not been entered yet
            self.roles.close()
            release_run_dir(self.run_dir)
            raise
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
                if not done_before:
                    self.rollouts.start(
                        self.rollout, self.sampler, steps_done=self.step, last_step=self.cfg.train.max_steps
                    )
                self._loop(result, stop, logger, progress, on_step)
            self.rollouts.close()
            self._finish(result, stop)
        finally:
            self.rollouts.close()
            progress.close()
            logger.close()
            plot_curves(self.run_dir / "metrics.jsonl", self.run_dir / "curves.png")
            self.roles.close()  # aborts a batch still in flight
            self.rollouts.close(timeout=60)
            release_run_dir(self.run_dir)
        return result

    def _loop(
        self,
        result: RLResult,
        stop: SignalFlag,
        logger: MetricsLogger,
        progress: RLProgress,
        on_step: Callable[[int, dict[str, float]], None] | None,
    ) -> None:
        """train_step -> eval (every k) -> log -> checkpoint (every n, or on a signal), until done."""
        s = self.settings
        while self.step < s.total_steps and stop.signum is None:
            metrics = self._one_step(result)
            if metrics is None:
                if self.skipped >= MAX_SKIPPED_STEPS:
                    return
                continue
            if s.eval_due(self.step):
                result.eval = self.evaluate()
                metrics.update(result.eval)
            logger.log(metrics, self.step)
            progress.update(self.step, metrics)
            result.history.append(metrics)
            if on_step is not None:
                on_step(self.step, metrics)
            table = self.cfg.logger.progress_bar and due(s.log_every, self.step)
            log_samples(self._last_trajs, self.step, self.run_dir, console=table, tokenizer=self.tokenizer)
            evaluated = s.best_metric in metrics
            # with keep_best every eval step is also a save step, so the best checkpoint is always ranked
            if s.save_due(self.step) or stop.signum is not None or (self.cfg.ckpt.keep_best and evaluated):
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
        elif not self.learned and self.step > self._start_step:
            # every advantage was 0 (e.g. greedy sampling: a prompt's samples are identical, each group's
            # rewards equal): the policy loss was 0 at every step, so the "final model" is the starting one
            result.exit_code = 1
            result.message = (
                f"nothing to learn: no step of the run had a non-zero advantage ({self.cfg.algo.advantage}, "
                f"rollout.temperature {self.cfg.rollout.temperature}, {self.cfg.rollout.n_samples} samples per "
                "prompt: every group's rewards were equal); no final model written. Sample with "
                "--rollout.temperature > 0, or use a reward that tells the samples apart"
            )
        elif self.cfg.ckpt.save_final:  # off: the run ends after its last step (benchmarks)
            latest = self.ckpt.latest()
            if latest is None or latest.name != f"step_{self.step}":
                self.save_checkpoint(result.history[-1] if result.history else {})
            policy, final = self.roles.policy, str(self.run_dir / "final")
            result.final_model = timed_write("final model", lambda: policy.call(PolicyWorker.export, final))

    def _build_logger(self) -> MetricsLogger:
        # a resumed run replays the steps after its checkpoint: their samples (like their metrics) go
        keep_rows_up_to(self.run_dir / SAMPLES_FILE, self.step)
        return build_logger(
            self.cfg.logger,
            self.run_dir,
            total_steps=self.cfg.train.max_steps,
            config=to_dict(self.cfg),
            start_step=self.step,
            console=False,  # the progress line (RLProgress) is RL's console output
        )

    def _one_step(self, result: RLResult) -> dict[str, float] | None:
        """train_step with the skip rule: a step with nothing to train is counted, logged, and skipped."""
        t0 = time.perf_counter()
        self.step += 1
        try:
            metrics = self.train_step()
        except NothingToTrain as e:
            if self.rollouts.overlaps:
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

    def _eval_and_log(self, logger: MetricsLogger, progress: RLProgress) -> dict[str, float]:
        metrics = self.evaluate()
        if metrics:
            logger.log(metrics, self.step)
            progress.update(self.step, metrics)
        return metrics

    # =========================================================================================== checkpoints
    def save_checkpoint(self, metrics: dict[str, float]) -> Path:
        """policy/ (+ critic/) folders, controller state (sampler, KL controller, reward norm, counters), RNG."""
        models = {"policy": WorkerFolder(self.roles.policy)}
        if self.roles.critic is not None:
            models["critic"] = WorkerFolder(self.roles.critic)
        metric = metrics.get(self.settings.best_metric)
        sampler = self.rollouts.sampler_state(self.sampler)
        extra = {  # async: the sampler as after this step's batch (the producer may have drawn further)
            "sampler": sampler,
            "kl": self.kl_ctl.state_dict(),
            "reward_norm": self.reward_norm.state_dict() if self.reward_norm is not None else None,
        }
        # the data position, also in trainer_state.json: a resume checks the sampler state against it
        state = {
            "skipped": self.skipped,
            "total_steps": self.cfg.train.max_steps,
            "prompts_drawn": batches_drawn(sampler),
            "learned": self.learned,
        }
        return self.ckpt.save(self.step, models=models, trainer_state=state, extra=extra, metric=metric)

    def resume(self) -> bool:
        """Restore per ckpt.resume (relayrl.training.setup.checkpoint_to_resume); True when resumed."""
        path = checkpoint_to_resume(self.cfg.ckpt.resume, self.ckpt)
        if path is None:
            return False
        loaded = self.ckpt.load(path)
        self.roles.policy.call(PolicyWorker.load, str(path / "policy"))
        self.roles.sync_weights(loaded.step)  # the engines start from the restored weights
        if self.roles.critic is not None:
            self.roles.critic.call(CriticWorker.load, str(path / "critic"))
        self.sampler.load_state_dict(  # same data order, at the recorded position (never skip or repeat)
            loaded.extra["sampler"], expect_batches=loaded.trainer_state.get("prompts_drawn"), where=str(path)
        )
        self.kl_ctl.load_state_dict(loaded.extra["kl"])
        if self.reward_norm is not None and loaded.extra.get("reward_norm"):
            self.reward_norm.load_state_dict(loaded.extra["reward_norm"])
        self.step = self.version = loaded.step
        self.skipped = int(loaded.trainer_state.get("skipped", 0))
        self.learned = bool(loaded.trainer_state.get("learned", True))
        print(f"relayrl rl: resumed from {path} (step {self.step})", flush=True)
        return True


def run_rl(cfg: RLConfig) -> RLResult:
    """Programmatic entry: build and run; errors while building propagate (the CLI turns them into exit 1)."""
    torch.set_num_threads(driver_threads(cfg))
    return RLTrainer(cfg).fit()


def _run_cli(cfg: RLConfig) -> int:
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
        print(
            f"relayrl rl: final model in {result.final_model or 'none'}; curves in {result.run_dir / 'curves.png'}"
        )
    elif result.message:
        print(f"relayrl rl: stopped: {result.message}", file=sys.stderr)
    return result.exit_code


def main(argv: list[str] | None = None) -> int:
    """`relayrl rl [--config run.yaml] [--section.field value ...]`."""

    def fn(cfg: RLConfig) -> int:
        try:
            return _run_cli(cfg)
        except ConfigError as e:
            print(f"relayrl rl: error: {e}", file=sys.stderr)
            return 2

    return run_command(RLConfig, argv, "relayrl rl", fn, description=(__doc__ or "").splitlines()[0])
