"""`--help` text generated from a config dataclass tree: every field grouped by component (nested groups
such as `model.lora` get their own heading), with its flag, metavar (type or {choices}), default and docstring.
"""

from __future__ import annotations

import dataclasses
import enum
import inspect
import textwrap
import typing
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Literal

from relayrl.config.base import (
    config_fields,
    default_instance,
    field_docs,
    join_path,
    strip_optional,
    to_dict,
)


def _fmt_default(v: Any) -> str:
    v = to_dict(v) if not isinstance(v, str) else v
    if isinstance(v, list):
        return ",".join(str(x) for x in v) if v else "[]"
    return "None" if v is None else str(v).lower() if isinstance(v, bool) else repr(v) if v == "" else str(v)


def _metavar(tp: Any) -> str:
    inner, _ = strip_optional(tp)
    origin = typing.get_origin(inner)
    if origin is Literal:
        return "{" + ",".join(str(c) for c in typing.get_args(inner)) + "}"
    if isinstance(inner, type) and issubclass(inner, enum.Enum):
        return "{" + ",".join(str(m.value) for m in inner) + "}"
    if origin in (list, tuple):
        return _metavar(typing.get_args(inner)[0]) + " [...]"
    if inner is bool:
        return "{true,false}"
    return {int: "INT", float: "FLOAT", str: "STR", Path: "PATH"}.get(inner, "VALUE")


def _help_groups(obj: Any, path: str, out: list[str]) -> None:
    cls = type(obj)
    docs = field_docs(cls)
    leaves, groups = [], []
    for name, tp in config_fields(cls):
        value = getattr(obj, name)
        (groups if dataclasses.is_dataclass(value) else leaves).append((name, tp, value))
    if leaves:
        title = (inspect.getdoc(cls) or cls.__name__).splitlines()[0]
        out.append(f"\n{path or 'options'}: {title}" if path else "\noptions:")
        for name, tp, value in leaves:
            flag = f"--{join_path(path, name)} {_metavar(tp)}"
            out.append(f"  {flag}  (default: {_fmt_default(value)})")
            doc = docs.get(name, "")
            for line in textwrap.wrap(doc, 96) if doc else []:
                out.append(f"      {line}")
    for name, _, value in groups:
        _help_groups(value, join_path(path, name), out)


def format_help(
    cls: type,
    *,
    prog: str,
    description: str | None = None,
    default: Any = None,
    presets: Mapping[str, Callable[[], Any]] | None = None,
) -> str:
    """The `--help` text: usage, description, then every field grouped by component with type and default."""
    obj = default if default is not None else default_instance(cls)
    out = [f"usage: {prog} [--config FILE.yaml] [--group.field VALUE ...]"]
    desc = description or inspect.getdoc(cls) or ""
    if desc:
        out += ["", desc]
    out += [
        "",
        "Values: --optim.lr 1e-5 or --optim.lr=1e-5; bools true/false; lists as several values or a,b;",
        "None as none. Precedence: defaults < --config FILE.yaml < flags.",
        "",
        "  --config FILE.yaml  load a YAML config (same keys, nested); flags override it",
    ]
    if presets:
        out.append(f"  --preset {{{','.join(presets)}}}  start from a preset (before --config and flags)")
    _help_groups(obj, "", out)
    return "\n".join(out)
