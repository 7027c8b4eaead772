"""Typed config: per-component dataclasses (`components`) and the generic CLI/YAML machinery (`base`).

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
    parse_cli,
    run_command,
    save_yaml,
    to_dict,
)
from relayrl.config.components import (
    CkptConfig,
    DataConfig,
    LoggerConfig,
    LoraConfig,
    ModelConfig,
    OptimConfig,
    TrainConfig,
)
from relayrl.config.help import format_help

__all__ = [
    "CkptConfig",
    "ConfigError",
    "ConfigWarning",
    "DataConfig",
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
