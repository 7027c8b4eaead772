"""`relayrl rl`'s config: parsing is torch-free, train.* lists only what RL reads, None off-policy bounds,
and every accepted-but-ineffective value is a ConfigError or exactly one one-line ConfigWarning."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import warnings

import pytest

from relayrl.config import ConfigError, ConfigWarning, format_help, parse_cli
from relayrl.config.rl import AlgoConfig, RLConfig, RLTrainConfig
from relayrl.trainers.rl.validate import resolve_algo, validate_rl

BASE = ["--model.name_or_path", "some/model", "--train.max_steps", "2"]


def test_parsing_an_rl_config_imports_no_torch():
    code = (
        "import sys\n"
        "from relayrl.config import parse_cli\n"
        "from relayrl.config.rl import RLConfig\n"
        "cfg = parse_cli(RLConfig, ['--algo.preset', 'ppo', '--algo.off_policy', 'icepop', '--train.max_steps', '3'])\n"
        "assert not any(m.startswith('relayrl.algorithms') for m in sys.modules), 'config imported algorithms'\n"
        "from relayrl.algorithms.presets import AlgoNames, resolve_names\n"
        "a = resolve_names(AlgoNames(preset=cfg.algo.preset, off_policy=cfg.algo.off_policy))\n"
        "assert (a.advantage, a.kl_mode, a.kl_estimator, a.off_policy) == ('gae', 'reward', 'k1', 'icepop')\n"
        "assert cfg.train.max_steps == 3\n"
        "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if 'torch' in m)[:5]\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_rl_train_config_holds_only_what_rl_reads():
    names = [f.name for f in dataclasses.fields(RLTrainConfig)]
    assert names == [
        "seed",
        "max_steps",
        "log_every",
        "device",
        "output_dir",
        "async_train",
        "max_staleness",
        "gil_switch_s",
    ]
    text = format_help(RLConfig, prog="relayrl rl")
    for gone in (
        "batch_size",
        "micro_batch_size",
        "max_tokens_per_micro_batch",
        "epochs",
        "eval_every",
        "packing",
    ):
        assert f"--train.{gone}" not in text
    assert "--train.max_steps" in text and "--algo.epochs" in text
    with pytest.raises(ConfigError, match="batch_size"):
        parse_cli(RLConfig, [*BASE, "--train.batch_size", "8"])
    with pytest.raises(ConfigError, match=r"train.log_every: 0 is invalid"):
        parse_cli(RLConfig, [*BASE, "--train.log_every", "0"])


def test_off_policy_bounds_default_to_the_method_own():
    a = AlgoConfig()
    assert (a.off_policy, a.off_policy_low, a.off_policy_high) == ("", None, None)
    assert resolve_algo(a).off_policy == "none"  # empty = none unless train.async_train (then tis)
    assert resolve_algo(a, async_train=True).off_policy == "tis"
    a = parse_cli(RLConfig, ["--algo.off_policy", "tis", "--algo.off_policy_high", "3"]).algo
    assert (a.off_policy_low, a.off_policy_high) == (None, 3.0)


def _validate(argv: list[str]) -> list[str]:
    """validate_rl on the parsed flags; the ConfigWarning messages it issued."""
    cfg = parse_cli(RLConfig, [*BASE, *argv])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resolved = validate_rl(cfg)
        assert validate_rl(resolved) == resolved  # idempotent: a resolved config warns the same way again
    msgs = [str(w.message) for w in caught if issubclass(w.category, ConfigWarning)]
    assert len(msgs) % 2 == 0 and msgs[: len(msgs) // 2] == msgs[len(msgs) // 2 :]
    return msgs[: len(msgs) // 2]


@pytest.mark.parametrize(
    ("argv", "want"),
    [
        (
            ["--critic.lr", "1e-3"],
            "critic.lr has no effect: algo.advantage='group_norm' trains no critic (estimators with one: gae)",
        ),
        (
            ["--algo.value_clip", "0.3"],
            "algo.value_clip has no effect: algo.advantage='group_norm' trains no critic",
        ),
        (
            [
                "--algo.preset",
                "grpo",
                "--critic.epochs",
                "2",
                "--critic.model_path",
                "m",
                "--algo.value_clip",
                "0.1",
            ],
            "critic.model_path, critic.epochs, algo.value_clip have no effect: algo.advantage='group_norm'",
        ),
        (
            ["--algo.kl_estimator", "k2"],
            "algo.kl_estimator has no effect: algo.kl_mode='none' computes no KL",
        ),
        (
            ["--algo.kl_controller", "adaptive"],
            "algo.kl_controller has no effect: algo.kl_mode='none' keeps the KL",
        ),
        (
            ["--algo.kl_mode", "monitor", "--algo.kl_target", "1", "--algo.kl_horizon", "50"],
            "algo.kl_target, algo.kl_horizon have no effect: algo.kl_mode='monitor' keeps the KL out",
        ),
        (
            ["--algo.kl_mode", "reward", "--algo.kl_coef", "0.1", "--algo.kl_target", "1"],
            "algo.kl_target has no effect: only the adaptive KL controller reads them",
        ),
        (
            ["--algo.off_policy_low", "0.3"],
            "algo.off_policy_low has no effect: algo.off_policy='none' uses no",
        ),
        (
            ["--filter.min_mean", "0.1", "--filter.max_refills", "5"],
            "filter.min_mean, filter.max_refills have no effect: dynamic filtering is off (filter.enabled=false)",
        ),
        (
            ["--eval.n_samples", "4", "--eval.temperature", "1.0"],
            "eval.n_samples, eval.temperature have no effect: evaluation is off (eval.every=0)",
        ),
        (
            ["--reward.overlong_penalty", "0.5"],
            "reward.overlong_penalty has no effect: the overlong penalty is off",
        ),
    ],
)
def test_ineffective_value_warns_once_naming_the_fields(argv, want):
    msgs = _validate(argv)
    assert len(msgs) == 1 and msgs[0].startswith(want) and "\n" not in msgs[0], msgs


@pytest.mark.parametrize(
    "argv",
    [
        [],
        ["--algo.preset", "ppo", "--critic.lr", "1e-3", "--algo.value_clip", "0.3", "--algo.kl_coef", "0.05"],
        [
            "--algo.kl_mode",
            "loss",
            "--algo.kl_coef",
            "0.1",
            "--algo.kl_controller",
            "adaptive",
            "--algo.kl_target",
            "1",
        ],
        ["--algo.kl_mode", "monitor", "--algo.kl_estimator", "k1"],
        ["--algo.preset", "grpo", "--algo.kl_mode", "none"],  # the preset's estimator is not the user's
        ["--algo.off_policy", "icepop", "--algo.off_policy_low", "0.3", "--algo.off_policy_high", "4"],
        ["--filter.enabled", "--filter.max_mean", "0.9"],
        ["--eval.every", "2", "--eval.n_samples", "4", "--eval.temperature", "1.0"],
        ["--reward.overlong_buffer", "4", "--reward.overlong_penalty", "0.5"],
    ],
)
def test_effective_values_do_not_warn(argv):
    assert _validate(argv) == []


@pytest.mark.parametrize("mode", ["none", "monitor"])
def test_kl_coef_without_a_kl_term_is_an_error(mode):
    cfg = parse_cli(RLConfig, [*BASE, "--algo.kl_mode", mode, "--algo.kl_coef", "0.1"])
    with pytest.raises(
        ConfigError, match=rf"algo.kl_coef: 0.1 has no effect with algo.kl_mode='{mode}'.*reward or loss"
    ):
        validate_rl(cfg)


def test_drop_sample_is_rejected_for_group_estimators():
    cfg = parse_cli(RLConfig, [*BASE, "--rollout.failure_policy", "drop_sample"])
    with pytest.raises(ConfigError, match="choose one of drop_group, zero_reward, raise"):
        validate_rl(cfg)
    cfg = parse_cli(
        RLConfig, [*BASE, "--rollout.failure_policy", "drop_sample", "--algo.advantage", "reinforce"]
    )
    validate_rl(cfg)


def test_dist_placement_in_local_mode_warns_and_in_ray_mode_does_not():
    (msg,) = _validate(["--dist.policy_num_gpus_per_node", "2", "--dist.offload", "true"])
    assert "dist.policy_num_gpus_per_node, dist.offload have no effect" in msg and "dist.mode=local" in msg
    assert _validate(["--dist.mode", "ray", "--dist.policy_num_gpus_per_node", "2"]) == []
    (msg,) = _validate(["--dist.mode", "ray", "--dist.critic_num_gpus_per_node", "2"])
    assert "dist.critic_num_gpus_per_node has no effect" in msg and "trains no critic" in msg


def test_colocated_roles_need_the_policy_size_and_ema_one_rank():
    ray2 = ["--dist.mode", "ray", "--dist.policy_num_gpus_per_node", "2"]
    kl = ["--algo.kl_mode", "loss", "--algo.kl_coef", "0.1"]
    cfg = parse_cli(RLConfig, [*BASE, *ray2, *kl, "--dist.colocate_policy_ref", "true"])
    with pytest.raises(
        ConfigError, match=r"dist.colocate_policy_ref: the ref role \(1 ranks\) must have the policy"
    ):
        validate_rl(cfg)
    ok = parse_cli(
        RLConfig, [*BASE, *ray2, *kl, "--dist.colocate_all", "true", "--dist.ref_num_gpus_per_node", "2"]
    )
    validate_rl(ok)
    validate_rl(parse_cli(RLConfig, [*BASE, *ray2, "--ema", "0.99"]))  # a sharded policy keeps a sharded EMA
    with pytest.raises(ConfigError, match=r"dist\.policy_num_gpus_per_node: 0 is invalid"):
        parse_cli(RLConfig, [*BASE, "--dist.policy_num_gpus_per_node", "0"])


@pytest.mark.parametrize(
    "text, match",
    [
        ("{not json", r"vllm_args: .* a JSON object of vllm\.EngineArgs \(Expecting"),
        ("[1, 2]", r"vllm_args: .* expected a JSON object of vllm\.EngineArgs"),
        ('{"tensor_parallel_size": 2}', r"no 'tensor_parallel_size': relayrl sets it from dist\.engine_tp"),
        ('{"max_model_len": 4096}', r"no 'max_model_len': relayrl sets it from rollout\.max_len"),
    ],
)
def test_vllm_args_must_be_an_object_without_the_keys_relayrl_derives(text, match):
    from relayrl.config.base import ConfigError
    from relayrl.config.rl import RolloutConfig

    with pytest.raises(ConfigError, match=match):
        RolloutConfig(vllm_args=text)
    assert RolloutConfig(vllm_args='{"enforce_eager": true}').vllm_engine_args() == {"enforce_eager": True}


def test_validate_rl_returns_a_resolved_copy_and_leaves_the_config_alone():
    cfg = parse_cli(RLConfig, [*BASE, "--algo.preset", "ppo", "--train.async_train", "true"])
    before = dataclasses.replace(cfg, algo=dataclasses.replace(cfg.algo))
    resolved = validate_rl(cfg)
    assert cfg == before and cfg.algo.advantage == "" and cfg.algo.off_policy == ""
    a = resolved.algo
    assert (a.advantage, a.policy_loss, a.kl_mode, a.kl_estimator, a.off_policy) == (
        "gae",
        "ppo",
        "reward",
        "k1",
        "tis",  # the async default
    )
    assert dataclasses.replace(resolved, algo=cfg.algo) == cfg  # only the algo names were filled in


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (["--algo.preset", "grpo2"], r"algo\.preset: 'grpo2' is not known; choose one of ppo, reinforce\+\+"),
        (["--algo.advantage", "gea"], r"algo\.advantage: 'gea' is not known; choose one of gae, reinforce"),
        (["--algo.off_policy", "is"], r"algo\.off_policy: 'is' is not known; choose one of none, tis"),
        (["--rollout.engine", "fast"], r"rollout\.engine: 'fast' is not known"),
    ],
)
def test_unknown_names_are_checked_once_by_the_validation_pass(argv, match):
    cfg = parse_cli(RLConfig, [*BASE, *argv])  # parsing reads no registry
    with pytest.raises(ConfigError, match=match):
        validate_rl(cfg)


def test_critic_optimizer_defaults_to_the_policy_schedule_with_the_critic_lr():
    cfg = parse_cli(
        RLConfig, ["--optim.lr", "3e-6", "--optim.scheduler", "linear", "--optim.warmup_steps", "5"]
    )
    assert cfg.critic.optimizer(cfg.optim) == dataclasses.replace(cfg.optim, lr=1e-4)
    cfg = parse_cli(
        RLConfig,
        [
            "--critic.lr",
            "2e-5",
            "--critic.optim.scheduler",
            "constant",
            "--critic.optim.max_grad_norm",
            "0.5",
        ],
    )
    opt = cfg.critic.optimizer(cfg.optim)
    assert (opt.lr, opt.scheduler, opt.max_grad_norm, opt.warmup_ratio) == (2e-5, "constant", 0.5, 0.03)
    with pytest.raises(
        ConfigError, match=r"critic\.optim\.warmup_ratio: 1\.5 is invalid; expected a float in"
    ):
        parse_cli(RLConfig, ["--critic.optim.warmup_ratio", "1.5"])
    with pytest.raises(ConfigError, match=r"critic\.lr: 0\.0 is invalid; expected a float > 0"):
        parse_cli(RLConfig, ["--critic.lr", "0"])


@pytest.mark.parametrize(
    ("argv", "want"),
    [
        (
            ["--critic.optim.scheduler", "constant"],
            "critic.optim.scheduler has no effect: algo.advantage='group_norm'",
        ),
        (
            ["--train.gil_switch_s", "0.0002"],
            "train.gil_switch_s has no effect: only the async rollout pipeline",
        ),
        (
            ["--rollout.vllm_gpu_util", "0.6"],
            "rollout.vllm_gpu_util has no effect: rollout.engine='native' is not",
        ),
    ],
)
def test_new_fields_warn_when_ineffective(argv, want):
    msgs = _validate(argv)
    assert len(msgs) == 1 and msgs[0].startswith(want), msgs


def test_vllm_gpu_util_is_a_fraction():
    with pytest.raises(ConfigError, match=r"rollout\.vllm_gpu_util: 1\.0 is invalid"):
        parse_cli(RLConfig, ["--rollout.vllm_gpu_util", "1"])
    assert _validate(["--rollout.engine", "vllm", "--rollout.vllm_gpu_util", "0.6"]) == []


def test_engine_tp_needs_separate_engines_of_a_tensor_parallel_engine():
    """dist.engine_tp is read from the engine's declared capabilities (rollout/build.py), not its name:
    separate engines need one with tensor_parallel (vllm, native); colocated, it is the native TP engine."""
    ray = ["--dist.mode", "ray", "--dist.num_engines", "1", "--dist.engine_tp", "2"]
    with pytest.raises(
        ConfigError, match=r"engine_tp=2 with separate engines .* vllm or native \(got 'hf'\)"
    ):
        validate_rl(parse_cli(RLConfig, [*BASE, *ray, "--rollout.engine", "hf"]))
    assert validate_rl(parse_cli(RLConfig, [*BASE, *ray])).dist.engine_tp == 2  # native TP engine actors
    with pytest.raises(
        ConfigError, match=r"engine_tp=2 \(colocated\) needs rollout.engine native \(got 'vllm'\)"
    ):
        validate_rl(parse_cli(RLConfig, [*BASE, "--rollout.engine", "vllm", "--dist.engine_tp", "2"]))
    with pytest.raises(ConfigError, match=r"engine_tp=2 \(colocated\) must divide the policy's 1 ranks"):
        validate_rl(parse_cli(RLConfig, [*BASE, "--dist.engine_tp", "2"]))
    colocated = ["--dist.mode", "ray", "--dist.policy_num_gpus_per_node", "2", "--dist.engine_tp", "2"]
    assert validate_rl(parse_cli(RLConfig, [*BASE, *colocated])).dist.engine_tp == 2
    with pytest.raises(ConfigError, match=r"\(colocated\) cannot overlap rollout and training"):
        validate_rl(parse_cli(RLConfig, [*BASE, *colocated, "--train.async_train", "true"]))
    resolved = validate_rl(
        parse_cli(RLConfig, [*BASE, *ray, "--rollout.engine", "vllm"])
    )  # vllm not imported
    assert (resolved.dist.engine_tp, resolved.rollout.engine) == (2, "vllm")


def test_config_accepts_auto_and_names_a_negative_budget():
    a = validate_rl(parse_cli(RLConfig, BASE)).algo
    assert (a.micro_batch_tokens, a.infer_micro_batch_tokens) == (0, 0)
    for name in ("micro_batch_tokens", "infer_micro_batch_tokens"):
        with pytest.raises(
            ConfigError, match=rf"algo\.{name}: -1 is invalid; expected 0 \(auto\) or an int >= 1"
        ):
            validate_rl(parse_cli(RLConfig, [*BASE, f"--algo.{name}", "-1"]))
