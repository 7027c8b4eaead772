"""Typed config: one home for every command's config, with no torch import.

    base.py          the dataclass tree <-> dict / YAML machinery, strict coercion, errors (`invalid`)
    help.py          `--help` text from field types, defaults and docstrings
    command_line.py  dotted flags, --config, --preset, --help; `run_command` (a command's main)
    components.py    model, data, optim, train, ckpt, logger; OneModelConfig (the one-model commands' sections)
    dist.py          DistConfig: the `dist` section of every command
    rl.py            `relayrl rl`: RLConfig and its sections; ResolvedRL (what validate_rl returns)
    recipes.py       sft, rm, prm, dpo, kto, kd
    generate.py      generate, iterative-dpo
    apps.py          chat, demo, serve, serve-rm
    presets.py       preset functions (tiny_cpu_config)

from relayrl.config import ModelConfig, OptimConfig, parse_cli, run_command, save_yaml
"""

from relayrl.config.base import (
    ConfigError,
    ConfigWarning,
    check_choices,
    field_docs,
    from_dict,
    invalid,
    load_yaml,
    merge,
    save_yaml,
    to_dict,
)
from relayrl.config.command_line import parse_cli, run_command
from relayrl.config.components import (
    CkptConfig,
    DataConfig,
    LoggerConfig,
    LoraConfig,
    ModelConfig,
    OptimConfig,
    TrainConfig,
)
from relayrl.config.dist import DistConfig
from relayrl.config.help import format_help

__all__ = [
    "CkptConfig",
    "ConfigError",
    "ConfigWarning",
    "DataConfig",
    "DistConfig",
    "LoggerConfig",
    "LoraConfig",
    "ModelConfig",
    "OptimConfig",
    "TrainConfig",
    "check_choices",
    "field_docs",
    "format_help",
    "from_dict",
    "invalid",
    "load_yaml",
    "merge",
    "parse_cli",
    "run_command",
    "save_yaml",
    "to_dict",
]
