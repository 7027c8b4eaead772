"""The command line of a config dataclass tree: `--group.field VALUE` flags, `--config FILE.yaml`, `--preset`,
`--help`, and the error boundary of a command.

    parse_cli(cls, argv, prog, description, default=, presets=) -> cls instance   (ConfigError before any work)
    run_command(cls, argv, prog, fn) -> exit code   parse, then fn(cfg) behind `error_boundary`
    error_boundary(prog, body) -> exit code           one-line errors (RELAYRL_DEBUG=1: the traceback)

Built on `base.py` (types, coercion, dict <-> dataclass, YAML) and `help.py` (the `--help` text).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

from relayrl.config.base import (
    ConfigError,
    coerce,
    config_fields,
    default_instance,
    is_dataclass_type,
    is_list_type,
    load_yaml,
    merge,
    strip_optional,
    type_name,
    unknown_key_error,
)
from relayrl.config.help import format_help

T = TypeVar("T")


def _lookup(cls: type, dotted: str) -> Any:
    """The type of the field at dotted path `dotted` under `cls` (ConfigError for unknown keys)."""
    parts = dotted.split(".")
    cur: Any = cls
    for i, part in enumerate(parts):
        prefix = ".".join(parts[:i])
        inner = strip_optional(cur)[0]
        if not is_dataclass_type(inner):
            raise ConfigError(f"unknown option --{dotted}: '{prefix}' is a {type_name(cur)}, not a group")
        fields_ = dict(config_fields(inner))
        if part not in fields_:
            raise unknown_key_error(inner, prefix, part, option=dotted)
        cur = fields_[part]
    if is_dataclass_type(strip_optional(cur)[0]):
        sub = ", ".join(f"--{dotted}.{n}" for n, _ in config_fields(strip_optional(cur)[0]))
        raise ConfigError(f"--{dotted} is a group of options; set its fields: {sub}")
    return cur


def _split_flags(argv: Sequence[str]) -> list[tuple[str, list[str], bool]]:
    """[(flag name without --, values, had '=')] in order; bare tokens before any flag are errors."""
    out: list[tuple[str, list[str], bool]] = []
    for tok in argv:
        if tok.startswith("--") and len(tok) > 2:
            name, eq, val = tok[2:].partition("=")
            out.append((name, [val] if eq else [], bool(eq)))
        elif tok == "--":
            continue
        elif not out:
            raise ConfigError(f"unexpected argument {tok!r}: options look like --group.field VALUE")
        else:
            out[-1][1].append(tok)
    return out


def _cli_overrides(cls: type, flags: list[tuple[str, list[str], bool]]) -> dict[str, Any]:
    """Nested dict of typed values from parsed flags (later flags win)."""
    overrides: dict[str, Any] = {}
    for name, values, had_eq in flags:
        dotted = name.replace("-", "_")
        tp = _lookup(cls, dotted)
        inner = strip_optional(tp)[0]
        if is_list_type(tp):
            raw: Any = values if not had_eq else values[0]
            if strip_optional(tp)[1] and [v.lower() for v in values] in (["none"], ["null"]):
                raw = None
        elif inner is bool and not values:
            raw = "true"  # a bare --train.packing means true
        elif len(values) != 1:
            what = "a value" if not values else f"one value, got {len(values)}: {' '.join(values)}"
            raise ConfigError(f"--{name} expects {what} ({type_name(tp)})", field=dotted)
        else:
            raw = values[0]
        value = coerce(raw, tp, dotted, from_cli=True)
        node = overrides
        *parents, leaf = dotted.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return overrides


def parse_cli(
    cls: type[T],
    argv: Sequence[str] | None = None,
    prog: str | None = None,
    description: str | None = None,
    *,
    default: T | None = None,
    presets: Mapping[str, Callable[[], T]] | None = None,
) -> T:
    """Build a `cls` config from the command line: `default` (or `--preset NAME` from `presets`), then
    `--config FILE.yaml`, then dotted flags. `--help` prints the generated help and exits 0.

    Raises `ConfigError` (before any work starts) for unknown keys, wrong types and invalid values."""
    argv = list(sys.argv[1:] if argv is None else argv)
    prog = prog or cls.__name__
    if "-h" in argv or "--help" in argv:
        print(format_help(cls, prog=prog, description=description, default=default, presets=presets))
        raise SystemExit(0)
    flags = _split_flags(argv)
    cfg = default
    rest = []
    for name, values, had_eq in flags:
        if name == "preset":
            cfg = _pick_preset(presets, values)
        elif name != "config":
            rest.append((name, values, had_eq))
    for name, values, _ in flags:
        if name == "config":
            if len(values) != 1:
                raise ConfigError("--config expects one YAML file path")
            cfg = load_yaml(cls, values[0], cfg if cfg is not None else default_instance(cls))
    overrides = _cli_overrides(cls, rest)
    base = cfg if cfg is not None else default_instance(cls)
    return merge(base, overrides)


def _pick_preset(presets: Mapping[str, Callable[[], Any]] | None, values: list[str]) -> Any:
    if not presets:
        raise ConfigError("--preset: this command has no presets")
    if len(values) != 1 or values[0] not in presets:
        got = " ".join(values) or "nothing"
        raise ConfigError(f"--preset: {got!r} is not a preset; choose one of: {', '.join(presets)}")
    return presets[values[0]]()


def run_command(
    cls: type[T],
    argv: Sequence[str] | None,
    prog: str,
    fn: Callable[[T], int | None],
    *,
    description: str | None = None,
    default: T | None = None,
    presets: Mapping[str, Callable[[], T]] | None = None,
) -> int:
    """A command's `main`: parse the config; on `ConfigError` print it to stderr and return 2; on --help
    return 0; else return `fn(cfg)` (None -> 0) behind the error boundary (`error_boundary`)."""
    try:
        cfg = parse_cli(cls, argv, prog, description, default=default, presets=presets)
    except ConfigError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        print(f"Run `{prog} --help` for the options.", file=sys.stderr)
        return 2
    except SystemExit as e:
        return int(e.code or 0)
    return error_boundary(prog, lambda: fn(cfg))


DEBUG_ENV = "RELAYRL_DEBUG"
"""Set to 1 to get the full traceback of a failing command instead of its one-line error."""

_PLAIN = (ValueError, RuntimeError, OSError, ImportError, KeyError, TypeError)


def error_boundary(prog: str, body: Callable[[], int | None]) -> int:
    """Run a command's body; any error becomes ONE line on stderr, `<prog>: error: <message>`, and exit code 1
    (2 for a ConfigError, 130 for Ctrl-C); the traceback only with RELAYRL_DEBUG=1. The messages of relayrl's
    own errors name the file, row, key or field and what to do."""
    try:
        return int(body() or 0)
    except ConfigError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        if os.environ.get(DEBUG_ENV, "") not in ("", "0"):
            raise
        text = str(e).strip() or type(e).__name__
        if not isinstance(e, _PLAIN) or type(e) in (KeyError, TypeError):
            text = f"{type(e).__name__}: {text}"
        print(f"{prog}: error: {text}", file=sys.stderr)
        print(f"{prog}: (set {DEBUG_ENV}=1 for the traceback)", file=sys.stderr)
        return 1
