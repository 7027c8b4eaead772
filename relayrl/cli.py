"""`relayrl <command>`: the command-line entry point.

Each command lives in its own module and exposes `main(argv: list[str]) -> int`, parsing its own typed
config (relayrl/config) so `relayrl <command> --help` lists that command's fields.

Parse first, import later: the table below names each command's config class (relayrl/config imports
nothing but itself: no torch, no transformers), so `relayrl <command> --help`, an unknown flag or a bad value
answer in well under a second, before the command's module (and torch with it) is imported by name with
`importlib`. The command's `main` then parses the same arguments again (milliseconds) and runs. A missing
optional dependency only affects its own command.
"""

from __future__ import annotations

import importlib
import sys
from dataclasses import dataclass

from relayrl import __version__
from relayrl.config.apps import ChatConfig, DemoConfig, ServeConfig, ServeRMConfig
from relayrl.config.base import ConfigError
from relayrl.config.command_line import parse_cli
from relayrl.config.generate import GenerateConfig, IterativeDPOConfig
from relayrl.config.recipes import DPOConfig, KDConfig, KTOConfig, PRMConfig, RMConfig, SFTConfig
from relayrl.config.rl import RLConfig


@dataclass(frozen=True, slots=True)
class Command:
    """One `relayrl <name>` command."""

    main: str
    """"module:function" of its `main(argv) -> int`, imported only after the arguments parsed."""
    summary: str
    """One line for `relayrl --help` (and the description of the command's own --help)."""
    config: type | None = None
    """The config class its arguments parse into (checked before the import); None: the command parses its
    arguments itself (merge-lora's positional folders)."""


COMMANDS: dict[str, Command] = {
    "demo": Command(
        "relayrl.apps.demo:main",
        "Embedded demo on CPU: tiny model, SFT then RL on a built-in task.",
        DemoConfig,
    ),
    "sft": Command(
        "relayrl.trainers.sft:main",
        "Supervised fine-tuning (response-only, multi-turn or pretrain loss).",
        SFTConfig,
    ),
    "rm": Command(
        "relayrl.trainers.rm:main", "Reward model (Bradley-Terry) on chosen / rejected pairs.", RMConfig
    ),
    "prm": Command(
        "relayrl.trainers.prm:main", "Process reward model: per-step labels at placeholder tokens.", PRMConfig
    ),
    "dpo": Command("relayrl.trainers.dpo:main", "DPO / IPO / cDPO on preference pairs.", DPOConfig),
    "kto": Command("relayrl.trainers.kto:main", "KTO on desirable / undesirable responses.", KTOConfig),
    "kd": Command(
        "relayrl.trainers.kd:main",
        "Knowledge distillation from a teacher (forward / reverse KL, JSD).",
        KDConfig,
    ),
    "rl": Command(
        "relayrl.trainers.rl.loop:main",
        "RL training: PPO / REINFORCE++ / GRPO / RLOO / Dr.GRPO / GSPO.",
        RLConfig,
    ),
    "eval": Command(
        "relayrl.apps.eval:main",
        "Evaluate a model (pass@k, reward) on a task or eval set, no training.",
        RLConfig,
    ),
    "generate": Command(
        "relayrl.apps.generate:main",
        "Batch generation: n samples, scoring, best-of-n, rejection sampling, DPO pairs.",
        GenerateConfig,
    ),
    "iterative-dpo": Command(
        "relayrl.apps.iterative_dpo:main",
        "Iterative DPO: generate -> score -> pairs -> DPO, for K rounds.",
        IterativeDPOConfig,
    ),
    "chat": Command("relayrl.apps.chat:main", "Interactive terminal chat with a model folder.", ChatConfig),
    "serve": Command(
        "relayrl.apps.serve:main", "OpenAI-compatible server over a rollout engine.", ServeConfig
    ),
    "serve-rm": Command("relayrl.apps.serve_rm:main", "Serve a local reward model over HTTP.", ServeRMConfig),
    "merge-lora": Command("relayrl.apps.merge_lora:main", "Merge a LoRA adapter into its base model."),
}


def quiet_progress_bars() -> None:
    """No per-file progress bars from transformers / huggingface_hub (weights loading, shard writing at every
    checkpoint): relayrl's own progress line says what is happening. In this process only."""
    try:
        from huggingface_hub.utils import disable_progress_bars
        from transformers.utils import logging as hf_logging
    except ImportError:
        return
    hf_logging.disable_progress_bar()
    disable_progress_bars()


def _usage() -> str:
    width = max(len(n) for n in COMMANDS)
    lines = ["usage: relayrl <command> [--help] [options]    (relayrl --version)", "", "commands:"]
    lines += [f"  {name.ljust(width)}  {cmd.summary}" for name, cmd in COMMANDS.items()]
    lines += ["", "Run `relayrl <command> --help` for a command's options."]
    return "\n".join(lines)


def check_arguments(name: str, argv: list[str]) -> int | None:
    """Parse `argv` as command `name`'s config without importing the command: the exit code when that ends
    the command (0 after --help, 2 after a config error, printed as the command prints it), None to run."""
    cmd = COMMANDS[name]
    if cmd.config is None:
        return None
    prog = f"relayrl {name}"
    try:
        parse_cli(cmd.config, argv, prog, f"`{prog}`: {cmd.summary}")
    except ConfigError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        print(f"Run `{prog} --help` for the options.", file=sys.stderr)
        return 2
    except SystemExit as e:  # --help printed
        return int(e.code or 0)
    return None


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0
    if argv[0] in ("-V", "--version", "version"):
        print(f"relayrl {__version__}")
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"relayrl: unknown command {name!r}; choose one of: {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    early = check_arguments(name, rest)
    if early is not None:
        return early
    quiet_progress_bars()
    module_name, func_name = COMMANDS[name].main.split(":")
    func = getattr(importlib.import_module(module_name), func_name)
    return int(func(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
