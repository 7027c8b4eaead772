"""The one `dist` section: every command parses it, each rejects the fields it never reads, and `ranks(role)`
sizes a one-model command's model and rl's roles from their own fields."""

from __future__ import annotations

import pytest

from relayrl.config import ConfigError, parse_cli
from relayrl.config.dist import MODEL_SIZE_FIELDS, RL_ONLY_FIELDS, DistConfig
from relayrl.config.generate import IterativeDPOConfig
from relayrl.config.recipes import DPOConfig, SFTConfig
from relayrl.config.rl import RLConfig


def test_ranks_of_a_model_and_of_rl_roles():
    d = DistConfig(mode="ray", num_nodes=2, num_gpus_per_node=3, policy_num_gpus_per_node=4, ref_num_nodes=2)
    assert (d.ranks("model"), d.ranks("policy"), d.ranks("ref"), d.ranks("critic")) == (6, 4, 2, 1)
    local = DistConfig(num_nodes=2, num_gpus_per_node=3, policy_num_gpus_per_node=4)
    assert [local.ranks(r) for r in ("model", "policy", "ref", "critic")] == [1, 1, 1, 1]


def test_one_model_commands_take_their_size_flags():
    cfg = parse_cli(
        SFTConfig, ["--dist.mode", "ray", "--dist.num_gpus_per_node", "2", "--dist.offload", "true"]
    )
    assert (cfg.dist.ranks("model"), cfg.dist.offload) == (2, True)
    cfg = parse_cli(RLConfig, ["--dist.mode", "ray", "--dist.policy_num_gpus_per_node", "2"])
    assert cfg.dist.ranks("policy") == 2


@pytest.mark.parametrize("cls", [SFTConfig, DPOConfig, IterativeDPOConfig])
@pytest.mark.parametrize(("flag", "value"), [("num_engines", "2"), ("policy_num_gpus_per_node", "2")])
def test_one_model_commands_refuse_rl_fields(cls, flag, value):
    with pytest.raises(
        ConfigError, match=rf"^dist\.{flag}: this command does not read it; .*--dist\.num_nodes"
    ):
        parse_cli(cls, [f"--dist.{flag}", value])


@pytest.mark.parametrize("flag", MODEL_SIZE_FIELDS)
def test_rl_refuses_the_one_model_size_fields(flag):
    with pytest.raises(
        ConfigError, match=rf"^dist\.{flag}: this command does not read it; .*policy_num_nodes"
    ):
        parse_cli(RLConfig, [f"--dist.{flag}", "2"])


def test_rl_only_fields_are_rl_fields_and_checks_ignore_defaults():
    names = {f for f in DistConfig.__dataclass_fields__}
    assert set(RL_ONLY_FIELDS) <= names and not set(RL_ONLY_FIELDS) & set(MODEL_SIZE_FIELDS)
    DistConfig().check_command("model")
    DistConfig().check_command("rl")


def test_mode_is_a_choice_and_sizes_are_positive():
    with pytest.raises(
        ConfigError, match=r"dist\.mode: 'slurm' is not a valid choice; choose one of: 'local', 'ray'"
    ):
        parse_cli(RLConfig, ["--dist.mode", "slurm"])
    with pytest.raises(ConfigError, match=r"dist\.num_gpus_per_node: 0 is invalid; expected an int >= 1"):
        parse_cli(SFTConfig, ["--dist.num_gpus_per_node", "0"])
