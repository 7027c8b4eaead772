"""`algo.preset`: one setting picks an algorithm; explicit fields win; defaults reach the built objects.

- `--algo.preset gspo`: the policy worker's loss step runs GSPO with the paper's clip range 3e-4 / 4e-4
  (seen through clip_frac on sequences whose ratio sits just inside / outside that range), not PPO's 0.2.
- a flag (or YAML value) set explicitly overrides the preset's value; the resolved config is saved.
- an unknown preset fails before any work (exit 2, the validation pass), listing every preset; `--help` lists
  them too.
- preset ppo builds a critic and a reference model; kl_mode=reward defaults to the k1 estimator.
"""

from __future__ import annotations

import pytest
import torch
import yaml

from relayrl.algorithms import ALGORITHM_PRESETS
from relayrl.algorithms.objective import PolicyTerms
from relayrl.config.command_line import parse_cli
from relayrl.config.help import format_help
from relayrl.config.presets import tiny_cpu_config
from relayrl.config.rl import RLConfig
from relayrl.trainers.rl.loop import RLTrainer, main
from relayrl.trainers.rl.validate import resolve_algo, validate_rl
from relayrl.workers.base import SequenceBatch
from relayrl.workers.builders import build_policy_objective
from relayrl.workers.model_ops import row_logprobs


def _cfg(tmp_path, *argv: str, model: str = "unused") -> RLConfig:
    return parse_cli(RLConfig, list(argv), default=tiny_cpu_config(model, str(tmp_path / "run"), steps=1))


# mean log-ratio log(pi / pi_old) of each sequence and its advantage sign. GSPO's sequence ratio
# s = exp(mean log-ratio) is clipped when s > 1 + eps_high (A > 0) or s < 1 - eps_low (A < 0):
#   log(1 + 4e-4) = 3.9992e-4, log(1 - 3e-4) = -3.00045e-4
SEQS = [
    (5e-4, 1.0),  # s = 1.0005 > 1.0004: clipped by eps_high 4e-4
    (-3.5e-4, -1.0),  # s = 0.99965 < 0.9997: clipped by eps_low 3e-4
    (3.5e-4, 1.0),  # s = 1.00035 inside 1.0004 (would be clipped by an eps_high of 3e-4)
    (-2.5e-4, -1.0),  # s = 0.99975 inside 0.9997 (would be clipped by an eps_low of 2e-4)
]


def _clip_frac(model, cfg: RLConfig) -> float:
    """clip_frac of one policy-loss step (the worker's code path) on 4 equal-length sequences whose old
    log-probs are shifted so that each sequence has the mean log-ratio of SEQS."""
    n, prompt = 8, 3
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(4, 100, (len(SEQS), n), generator=g)
    attn = torch.ones_like(ids, dtype=torch.bool)
    act = attn.clone()
    act[:, :prompt] = False
    batch = SequenceBatch(
        input_ids=ids, attention_mask=attn, action_mask=act, rollout_logprobs=torch.zeros(ids.shape)
    )
    rows = list(range(len(SEQS)))
    lp, _ = row_logprobs(model, batch, rows, "padded", temperature=cfg.rollout.temperature)
    shift = torch.tensor([d for d, _ in SEQS])[:, None]
    adv = torch.tensor([a for _, a in SEQS])[:, None].expand(ids.shape)
    objective = build_policy_objective(cfg.algo, cfg.rollout.max_new_tokens)
    terms = PolicyTerms(
        logprobs=lp,
        old_logprobs=(lp.detach() - shift) * act,
        advantages=adv * act,
        action_mask=act,
        rollout_logprobs=torch.zeros(ids.shape),
    )
    out = objective(terms)
    return float(out.metrics["clip_frac"] / out.metric_counts["clip_frac"])


def test_gspo_preset_reaches_the_loss_with_its_own_clip_range(tiny_model, tmp_path):
    cfg = validate_rl(_cfg(tmp_path, "--algo.preset", "gspo"))
    a = cfg.algo
    assert (a.advantage, a.policy_loss, a.aggregation, a.kl_mode) == (
        "group_norm",
        "gspo",
        "seq_mean_token_mean",
        "none",
    )
    assert a.clip_eps_low is None and a.clip_eps_high is None  # the loss's own default applies
    # equal lengths: the first two of four sequences are clipped -> clip_frac = 2/4
    assert _clip_frac(tiny_model, cfg) == pytest.approx(0.5, abs=1e-6)
    # explicit flags win over the preset: with PPO's +-0.2 nothing is clipped
    wide = validate_rl(
        _cfg(tmp_path, "--algo.preset", "gspo", "--algo.clip_eps_low", "0.2", "--algo.clip_eps_high", "0.2")
    )
    assert (wide.algo.clip_eps_low, wide.algo.clip_eps_high) == (0.2, 0.2)
    assert _clip_frac(tiny_model, wide) == 0.0
    # only eps_high 3e-4 set: sequence 3 (s = 1.00035) is clipped too -> 3/4
    tight = validate_rl(_cfg(tmp_path, "--algo.preset", "gspo", "--algo.clip_eps_high", "3e-4"))
    assert _clip_frac(tiny_model, tight) == pytest.approx(0.75, abs=1e-6)


def test_explicit_fields_override_the_preset_from_flags_and_yaml(tmp_path):
    a = resolve_algo(_cfg(tmp_path, "--algo.preset", "grpo", "--algo.aggregation", "token_mean").algo)
    # aggregation from the flag; the rest from the grpo preset
    assert (a.advantage, a.aggregation, a.kl_mode, a.kl_estimator) == (
        "group_norm",
        "token_mean",
        "loss",
        "k3",
    )
    # kl_mode none set explicitly beats the preset's loss (CLI "none" is the name, not "unset")
    a = resolve_algo(_cfg(tmp_path, "--algo.preset", "ppo", "--algo.kl_mode", "none").algo)
    assert (a.advantage, a.kl_mode) == ("gae", "none")
    # preset dapo sets 0.2 / 0.28; one explicit flag replaces one of them
    a = resolve_algo(_cfg(tmp_path, "--algo.preset", "dapo", "--algo.clip_eps_high", "0.3").algo)
    assert (a.policy_loss, a.clip_eps_low, a.clip_eps_high) == ("ppo", 0.2, 0.3)
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({"algo": {"preset": "cispo", "advantage": "rloo"}}))
    a = resolve_algo(_cfg(tmp_path, "--config", str(path)).algo)
    assert (a.advantage, a.policy_loss) == ("rloo", "cispo")
    # a flag replaces the YAML's preset; the YAML's explicit advantage still wins
    a = resolve_algo(_cfg(tmp_path, "--config", str(path), "--algo.preset", "gspo").algo)
    assert (a.advantage, a.policy_loss) == ("rloo", "gspo")


def test_no_preset_keeps_the_builtin_defaults(tmp_path):
    a = resolve_algo(_cfg(tmp_path).algo)
    assert (a.advantage, a.policy_loss, a.aggregation, a.kl_mode, a.kl_estimator) == (
        "group_norm",
        "ppo",
        "token_mean",
        "none",
        "k3",
    )
    assert a.clip_eps_low is None and a.clip_eps_high is None  # ppo's own 0.2 / 0.2
    assert resolve_algo(a) == a  # idempotent


@pytest.mark.parametrize(
    "argv,want",
    [
        (["--algo.kl_mode", "reward"], "k1"),
        (["--algo.kl_mode", "loss"], "k3"),
        (["--algo.kl_mode", "monitor"], "k3"),
        (["--algo.preset", "reinforce++_baseline"], "k2"),  # the preset's (loss, k2)
        (
            ["--algo.preset", "grpo", "--algo.kl_mode", "reward"],
            "k1",
        ),  # not the preset's mode: reward default
        (["--algo.kl_mode", "reward", "--algo.kl_estimator", "k2"], "k2"),  # explicit wins
    ],
)
def test_kl_estimator_defaults_follow_the_kl_mode(tmp_path, argv, want):
    assert resolve_algo(_cfg(tmp_path, *argv).algo).kl_estimator == want


def test_unknown_preset_fails_while_parsing_and_lists_the_presets(capsys):
    code = main(["--algo.preset", "grpo_typo"])  # no model, no data: parsing alone must fail
    err = capsys.readouterr().err
    assert code == 2
    assert "algo.preset" in err and "'grpo_typo'" in err
    assert all(name in err for name in ALGORITHM_PRESETS)
    code = main(["--algo.kl_estimator", "k4"])
    err = capsys.readouterr().err
    assert code == 2 and "algo.kl_estimator" in err and "k1, k2, k3" in err


def test_help_lists_every_preset():
    text = format_help(RLConfig, prog="relayrl rl")
    block = text[text.index("--algo.preset") :][:600]
    assert all(name in block for name in ALGORITHM_PRESETS), block


@pytest.mark.timeout(60)
def test_ppo_preset_builds_critic_and_reference_and_saves_resolved_config(tiny_model_path, tmp_path):
    cfg = _cfg(tmp_path, "--algo.preset", "ppo", model=str(tiny_model_path))
    trainer = RLTrainer(cfg)
    assert cfg.algo.advantage == ""  # the user's config is not changed; the trainer holds the resolved one
    try:
        assert trainer.roles.critic is not None and trainer.roles.reference is not None
    finally:
        trainer.roles.close()
    saved = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())["algo"]
    assert saved["preset"] == "ppo"
    assert (saved["advantage"], saved["kl_mode"], saved["kl_estimator"]) == ("gae", "reward", "k1")
    # the saved (resolved) config reloads to the same algorithm
    again = parse_cli(RLConfig, ["--config", str(tmp_path / "run" / "config.yaml")])
    assert validate_rl(again).algo == trainer.cfg.algo == validate_rl(cfg).algo


def test_native_engine_slots_default_to_the_samples_of_a_step(tiny_model_path, tmp_path):
    from relayrl.config.presets import tiny_cpu_config
    from relayrl.models.tiny import build_tiny_model, build_tiny_tokenizer
    from relayrl.workers.builders import build_engine_for

    cfg = tiny_cpu_config(str(tiny_model_path), str(tmp_path / "run"))
    tok = build_tiny_tokenizer()
    model = build_tiny_model(tok)
    engine = build_engine_for(cfg.rollout, cfg.eval, model, tok)
    try:
        assert engine.max_slots == cfg.rollout.prompts_per_step * cfg.rollout.n_samples == 32
    finally:
        engine.close()
    cfg.rollout.engine_slots = 5
    engine = build_engine_for(cfg.rollout, cfg.eval, model, tok)
    try:
        assert engine.max_slots == 5
    finally:
        engine.close()
