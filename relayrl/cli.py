"""`relayrl <command>`: the command-line entry point.

Each command lives in its own module and exposes `main(argv: list[str]) -> int`, parsing its own typed
config (relayrl/config) so `relayrl <command> --help` lists that command's fields. Commands are imported
lazily so `relayrl --help` is instant and a missing optional dependency only affects its own command.
"""

from __future__ import annotations

import importlib
import sys

from relayrl import __version__

# name -> ("module:function", one-line description)
COMMANDS: dict[str, tuple[str, str]] = {
    "demo": (
        "relayrl.apps.demo:main",
        "Embedded demo on CPU: tiny model, SFT then RL on a built-in task.",
    ),
    "sft": (
        "relayrl.trainers.sft:main",
        "Supervised fine-tuning (response-only, multi-turn or pretrain loss).",
    ),
    "rm": ("relayrl.trainers.rm:main", "Reward model (Bradley-Terry) on chosen / rejected pairs."),
    "prm": ("relayrl.trainers.prm:main", "Process reward model: per-step labels at placeholder tokens."),
    "dpo": ("relayrl.trainers.dpo:main", "DPO / IPO / cDPO on preference pairs."),
    "kto": ("relayrl.trainers.kto:main", "KTO on desirable / undesirable responses."),
    "kd": ("relayrl.trainers.kd:main", "Knowledge distillation from a teacher (forward / reverse KL, JSD)."),
    "rl": ("relayrl.trainers.rl.loop:main", "RL training: PPO / REINFORCE++ / GRPO / RLOO / Dr.GRPO / GSPO."),
    "eval": (
        "relayrl.apps.eval:main",
        "Evaluate a model (pass@k, reward) on a task or eval set, no training.",
    ),
    "generate": (
        "relayrl.apps.generate:main",
        "Batch generation: n samples, scoring, best-of-n, rejection sampling, DPO pairs.",
    ),
    "iterative-dpo": (
        "relayrl.apps.iterative_dpo:main",
        "Iterative DPO: generate -> score -> pairs -> DPO, for K rounds.",
    ),
    "chat": ("relayrl.apps.chat:main", "Interactive terminal chat with a model folder."),
    "serve": ("relayrl.apps.serve:main", "OpenAI-compatible server over a rollout engine."),
    "serve-rm": ("relayrl.apps.serve_rm:main", "Serve a local reward model over HTTP."),
    "merge-lora": ("relayrl.apps.merge_lora:main", "Merge a LoRA adapter into its base model."),
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
    lines += [f"  {name.ljust(width)}  {desc}" for name, (_, desc) in COMMANDS.items()]
    lines += ["", "Run `relayrl <command> --help` for a command's options."]
    return "\n".join(lines)


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
    quiet_progress_bars()
    module_name, func_name = COMMANDS[name][0].split(":")
    func = getattr(importlib.import_module(module_name), func_name)
    return int(func(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
