"""Every `relayrl ...` command written in the README and docs/*.md parses with its command's config (each flag
exists and each value is valid), and every example config in examples/configs runs on the tiny model.

Command lines come from ```bash blocks (continuation lines joined, comments dropped) and from inline code spans
that start with `relayrl `. Placeholders (`...`, PATH, <run>) stay as written: they are strings to the parser.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOC_FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SHELL_OPS = {"&&", "||", "|", "&", ";", ">", "2>&1"}


def _configs() -> dict:
    from relayrl.config.apps import ChatConfig, DemoConfig, ServeConfig, ServeRMConfig
    from relayrl.config.generate import GenerateConfig, IterativeDPOConfig
    from relayrl.config.recipes import DPOConfig, KDConfig, KTOConfig, PRMConfig, RMConfig, SFTConfig
    from relayrl.config.rl import RLConfig

    return {
        "demo": DemoConfig,
        "sft": SFTConfig,
        "rl": RLConfig,
        "eval": RLConfig,
        "rm": RMConfig,
        "prm": PRMConfig,
        "dpo": DPOConfig,
        "kto": KTOConfig,
        "kd": KDConfig,
        "generate": GenerateConfig,
        "iterative-dpo": IterativeDPOConfig,
        "chat": ChatConfig,
        "serve": ServeConfig,
        "serve-rm": ServeRMConfig,
    }


def _bash_lines(text: str) -> list[tuple[int, str]]:
    out, in_block, buf, start = [], False, "", 0
    for no, line in enumerate(text.splitlines(), 1):
        if line.strip().startswith("```"):
            in_block = line.strip() == "```bash"
            continue
        if not in_block:
            continue
        line = line.split(" #", 1)[0] if not line.lstrip().startswith("#") else ""
        if not buf:
            start = no
        if line.rstrip().endswith("\\"):
            buf += line.rstrip()[:-1] + " "
            continue
        buf += line
        if buf.strip():
            out.append((start, buf.strip()))
        buf = ""
    return out


def _inline_lines(text: str) -> list[tuple[int, str]]:
    return [
        (no, m.group(1))
        for no, line in enumerate(text.splitlines(), 1)
        for m in re.finditer(r"`(relayrl [^`]+)`", line)
    ]


def documented_commands() -> list[tuple[str, list[str]]]:
    """[(where, argv after `relayrl`)] for every documented command line."""
    found = []
    for path in DOC_FILES:
        text = path.read_text()
        for no, line in _bash_lines(text) + _inline_lines(text):
            line = re.sub(r"\[[^\]]*\]", " ", line)  # usage syntax: optional parts
            try:
                words = shlex.split(line)
            except ValueError:
                continue
            for i, w in enumerate(words):
                if w != "relayrl" or i + 1 >= len(words):
                    continue
                argv = []
                for a in words[i + 1 :]:
                    if a in SHELL_OPS:
                        break
                    argv.append(a)
                found.append((f"{path.relative_to(ROOT)}:{no}", argv))
    return found


COMMANDS = documented_commands()


def test_the_docs_document_the_commands():
    names = {argv[0] for _, argv in COMMANDS if argv}
    for cmd in ("sft", "rl", "rm", "dpo", "kto", "kd", "prm", "generate", "eval", "serve", "merge-lora"):
        assert cmd in names, f"no documented `relayrl {cmd}` command line"


@pytest.mark.parametrize("where,argv", COMMANDS, ids=[f"{w}:{' '.join(a)[:40]}" for w, a in COMMANDS])
def test_documented_command_parses(where, argv):
    from relayrl.cli import COMMANDS as CLI
    from relayrl.config.base import ConfigError
    from relayrl.config.command_line import parse_cli

    if not argv or argv[0].startswith(("-", "<")):  # `relayrl --help`, `relayrl <command>`
        return
    cmd, rest = argv[0], [a for a in argv[1:] if a != "..."]
    assert cmd in CLI, f"{where}: `relayrl {cmd}` is not a command"
    if cmd == "merge-lora":
        positional = [a for a in rest if not a.startswith("-")]
        assert not rest or len(positional) >= 2, f"{where}: merge-lora needs ADAPTER_DIR OUT_DIR"
        return
    if "--help" in rest or "-h" in rest:
        return
    configs = _configs()
    assert cmd in configs, f"{where}: no config class known to this test for `relayrl {cmd}`"
    cls, args = configs[cmd], []
    i = 0
    while i < len(rest):  # a flag whose value is a placeholder (NAME, N) or absent: the field must exist
        flag = rest[i]
        value = rest[i + 1] if i + 1 < len(rest) else None
        if flag.startswith("--") and (
            value is None or value.startswith("--") or PLACEHOLDER.fullmatch(value)
        ):
            assert _has_field(cls, flag[2:]), f"{where}: `relayrl {cmd}` has no option {flag}"
            i += 1 if value is None or value.startswith("--") else 2
            continue
        args.append(flag)
        i += 1
    try:
        parse_cli(cls, [a for a in args if a != "--config" and not a.endswith(".yaml")])
    except ConfigError as e:
        pytest.fail(f"{where}: `relayrl {' '.join(argv)}` does not parse: {e}")


PLACEHOLDER = re.compile(r"[A-Z][A-Z_0-9]*")
"""A value written as a placeholder in usage lines (NAME, N, PATH)."""


def _has_field(cls: type, dotted: str) -> bool:
    import dataclasses
    import typing

    for part in dotted.split("."):
        if not dataclasses.is_dataclass(cls):
            return False
        hints = typing.get_type_hints(cls)
        if part not in {f.name for f in dataclasses.fields(cls)}:
            return False
        cls = hints[part]
    return True


# ---------------------------------------------------------------------------------------------- example configs
def _header_command(yaml_path: Path) -> list[str]:
    """The `relayrl rl --config ...` line in the example's header comment."""
    for line in yaml_path.read_text().splitlines():
        if line.startswith("#") and "relayrl rl --config" in line:
            return shlex.split(line.lstrip("# ").strip())[2:]  # after `relayrl rl`
    raise AssertionError(f"{yaml_path} has no `relayrl rl --config ...` line in its header")


@pytest.mark.parametrize("name", sorted(p.stem for p in (ROOT / "examples" / "configs").glob("*.yaml")))
def test_example_config_runs_as_written(name, tiny_model_path, tmp_path, monkeypatch, capsys):
    """The header's command with PATH / FILE filled in (the tiny model, a prompts file), bounded to 2 steps.
    The remote-RM example gets two real `relayrl serve-rm` servers; the ports in its URLs are the only change."""
    import json

    from relayrl.trainers.rl.loop import main

    monkeypatch.chdir(ROOT)  # the examples name files relative to the repository root
    yaml_path = ROOT / "examples" / "configs" / f"{name}.yaml"
    argv = _header_command(yaml_path)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        "".join(json.dumps({"input": f"{a}+{a}=", "label": str(2 * a)}) + "\n" for a in range(10, 20))
    )
    argv = [str(tiny_model_path) if a == "PATH" else str(prompts) if a == "FILE" else a for a in argv]
    servers = []
    if name == "rl_remote_rm":
        urls, servers = _rm_servers(tmp_path)
        argv += ["--reward.source", ",".join(urls)]
    argv += [
        "--train.max_steps",
        "2",
        "--train.output_dir",
        str(tmp_path / "run"),
        "--logger.progress_bar",
        "false",
    ]
    # a random tiny model never answers add2 exactly: with the exact-match reward file every group's rewards
    # are equal, and such a run must end as "nothing to learn" (exit 1, no final model), not as a success
    nothing_to_learn = name == "rl_reward_func"
    try:
        code = main(argv)
        err = capsys.readouterr().err
        if nothing_to_learn:
            assert code == 1 and "nothing to learn" in err, (code, err)
            assert not (tmp_path / "run" / "final").exists()
        else:
            assert code == 0, err
    finally:
        for proc in servers:
            proc.terminate()
            proc.communicate(timeout=20)
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "step" in r][-1] == 2


def _rm_servers(tmp_path: Path) -> tuple[list[str], list]:
    import os
    import socket
    import subprocess
    import sys
    import time
    import urllib.request

    from relayrl.config.components import ModelConfig
    from relayrl.models.tiny import build_tiny_tokenizer, save_tiny
    from relayrl.models.value_head import build_value_model, save_value_model

    tok = build_tiny_tokenizer()
    base = save_tiny(tmp_path / "base")
    rm = save_value_model(
        build_value_model(ModelConfig(name_or_path=str(base)), init="normal", pad_token_id=tok.pad_token_id),
        tok,
        tmp_path / "rm",
    )
    procs, urls = [], []
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    for _ in range(2):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        cmd = [
            sys.executable,
            "-m",
            "relayrl.cli",
            "serve-rm",
            "--model",
            str(rm),
            "--port",
            str(port),
            "--device",
            "cpu",
        ]
        procs.append(
            subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        )
        urls.append(f"http://127.0.0.1:{port}/get_reward")
    for proc, url in zip(procs, urls, strict=True):
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, proc.stdout.read()
            try:
                with urllib.request.urlopen(url.replace("/get_reward", "/health"), timeout=1):
                    break
            except OSError:
                assert time.monotonic() < deadline, f"{url} not up"
                time.sleep(0.1)
    return urls, procs
