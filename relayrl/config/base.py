"""Typed config machinery: a tree of dataclasses <-> dotted CLI flags, YAML and `--help`.

Generic over any nested dataclass tree (the components in `components.py`, a command's top-level config).
A config is built in layers, each strictly checked, so every error happens before any work starts:

    default instance (or a preset function)  ->  --config run.yaml  ->  dotted CLI flags (--optim.lr 1e-5)

Seams:
- `command_line.py`   `parse_cli(cls, argv, ...)` (the whole command line -> an instance; `--help`) and
  `run_command(cls, argv, prog, fn)` (parse, print a `ConfigError` to stderr and return 2, else `fn(cfg)`).
- `to_dict` / `from_dict` (strict) / `save_yaml` / `load_yaml`.
- `field_docs(cls)`   attribute docstrings (the string literal under each field), read with `ast`; they are
  the `--help` text.
- `invalid(field, value, valid)`   the error a component's `__post_init__` raises for a bad value; `from_dict`
  prefixes it with the dotted path (`optim.lr`).
- Every float must be finite: `nan` / `inf` are refused for every float field of every section, from YAML and
  flags (`coerce`) and in Python (`check_finite`, which `check_choices` calls).
- `help.py`   the `--help` text (`format_help`), generated from field types, defaults and docstrings.

Supported field types: bool, int, float, str, Path, Enum, Literal[...], X | None, list[X], tuple[X, ...],
tuple[X, Y] (length checked), dict[str, X], Any, nested dataclasses. We own this (argparse-free) instead of
using tyro so the error texts (path, bad key, close matches, valid choices) are exactly ours.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import difflib
import enum
import functools
import inspect
import itertools
import math
import operator
import textwrap
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, TypeVar

import yaml

T = TypeVar("T")

TRUE_WORDS = ("true", "yes", "on", "1")
FALSE_WORDS = ("false", "no", "off", "0")
NONE_WORDS = ("none", "null", "~")


class ConfigError(ValueError):
    """A bad config: unknown key, wrong type or invalid value. The message names the dotted field path."""

    def __init__(self, message: str, *, field: str | None = None, detail: str | None = None):
        super().__init__(message)
        self.field = field
        """Dotted path (relative to the object that raised) of the offending field, when known."""
        self.detail = detail
        """The message without the field name (lets `from_dict` re-prefix it with the full dotted path)."""


class ConfigWarning(UserWarning):
    """A config value that is accepted but has no effect (e.g. critic.lr without a critic), issued with
    `warnings.warn` as one line naming the field(s) and why. Make them errors with
    `warnings.simplefilter("error", ConfigWarning)` (in pytest: `-W error::relayrl.config.ConfigWarning`)."""


def invalid(field: str, value: Any, valid: str) -> ConfigError:
    """The error for a bad value, for `__post_init__`: `raise invalid("lr", self.lr, "a float > 0")`.

    Message: "lr: -1.0 is invalid; expected a float > 0"; `from_dict` turns the name into "optim.lr"."""
    detail = f"{value!r} is invalid; expected {valid}"
    return ConfigError(f"{field}: {detail}", field=field, detail=detail)


def check_finite(obj: Any) -> None:
    """Raise `invalid` (naming the dotted field) for a NaN or infinite float anywhere in dataclass `obj`, its
    nested sections, lists, tuples and mappings. `from_dict` already refuses them from YAML and flags; this
    covers direct construction in Python (`check_choices` calls it)."""
    bad = _non_finite(obj, "")
    if bad is not None:
        raise invalid(bad[0], bad[1], "a finite number")


def _non_finite(value: Any, path: str) -> tuple[str, float] | None:
    """(dotted path, value) of the first non-finite float in `value`, else None."""
    if isinstance(value, float):
        return None if math.isfinite(value) else (path, value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        items: Any = ((f.name, getattr(value, f.name)) for f in dataclasses.fields(value) if f.init)
    elif isinstance(value, Mapping):
        items = ((str(k), v) for k, v in value.items())
    elif isinstance(value, list | tuple):
        items = ((f"[{i}]", v) for i, v in enumerate(value))
    else:
        return None
    for key, v in items:
        found = _non_finite(v, f"{path}{key}" if key.startswith("[") else join_path(path, key))
        if found is not None:
            return found
    return None


def check_choices(obj: Any) -> None:
    """Raise `invalid` for any Literal / Enum field of dataclass `obj` holding a value outside its choices
    (dataclasses do not check types; `from_dict` does, this covers direct construction in Python), and for
    any non-finite float in it (`check_finite`)."""
    check_finite(obj)
    for name, tp in config_fields(type(obj)):
        inner, optional = strip_optional(tp)
        value = getattr(obj, name)
        if value is None and optional:
            continue
        if typing.get_origin(inner) is Literal and value not in typing.get_args(inner):
            raise invalid(name, value, type_name(inner))
        if isinstance(inner, type) and issubclass(inner, enum.Enum) and not isinstance(value, inner):
            raise invalid(name, value, type_name(inner))


# ---------------------------------------------------------------------------------------------------------
# Introspection
# ---------------------------------------------------------------------------------------------------------


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """Attribute docstrings of a dataclass (and its dataclass bases): {field name: docstring}."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if klass is object or not dataclasses.is_dataclass(klass):
            continue
        try:
            source = textwrap.dedent(inspect.getsource(klass))
        except (OSError, TypeError):  # defined in a REPL / exec: no source, no docs
            continue
        class_def = ast.parse(source).body[0]
        body = getattr(class_def, "body", [])
        for node, nxt in itertools.pairwise(body):
            if (
                isinstance(node, ast.AnnAssign)
                and isinstance(node.target, ast.Name)
                and isinstance(nxt, ast.Expr)
                and isinstance(nxt.value, ast.Constant)
                and isinstance(nxt.value.value, str)
            ):
                docs[node.target.id] = inspect.cleandoc(nxt.value.value)
    return docs


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def config_fields(cls: type) -> list[tuple[str, Any]]:
    """[(name, resolved type)] of the init fields of a dataclass, in declaration order."""
    hints = _hints(cls)
    return [(f.name, hints[f.name]) for f in dataclasses.fields(cls) if f.init]


def strip_optional(tp: Any) -> tuple[Any, bool]:
    """(X, True) for X | None, else (tp, False)."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) < len(typing.get_args(tp)):
            return (args[0] if len(args) == 1 else functools.reduce(operator.or_, args)), True
    return tp, False


def is_dataclass_type(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def is_list_type(tp: Any) -> bool:
    return typing.get_origin(strip_optional(tp)[0]) in (list, tuple)


def type_name(tp: Any) -> str:
    """A short human name for a field type: 'float', 'one of fp32, bf16', 'list of str', 'int or None'."""
    inner, optional = strip_optional(tp)
    origin = typing.get_origin(inner)
    if origin is Literal:
        name = "one of " + ", ".join(repr(c) for c in typing.get_args(inner))
    elif isinstance(inner, type) and issubclass(inner, enum.Enum):
        name = "one of " + ", ".join(repr(m.value) for m in inner)
    elif origin in (list, tuple):
        name = f"list of {type_name(typing.get_args(inner)[0])}"
    elif origin is dict:
        name = "mapping"
    elif origin in (typing.Union, types.UnionType):
        name = " or ".join(type_name(a) for a in typing.get_args(inner))
    elif inner is Any:
        name = "any value"
    elif is_dataclass_type(inner):
        name = f"a {inner.__name__} mapping"
    elif inner is Path:
        name = "path"
    else:
        name = getattr(inner, "__name__", str(inner))
    return f"{name} or None" if optional else name


# ---------------------------------------------------------------------------------------------------------
# Value coercion (one function for CLI strings and YAML values)
# ---------------------------------------------------------------------------------------------------------


def _type_error(path: str, value: Any, tp: Any) -> ConfigError:
    return ConfigError(f"{path}: {value!r} is not a valid {type_name(tp)}", field=path)


def coerce(value: Any, tp: Any, path: str, *, from_cli: bool = False) -> Any:
    """`value` converted to type `tp`, or a `ConfigError` naming `path`, the value and the expected type.

    `from_cli` values are strings (or lists of strings for list fields) and are parsed; YAML values are
    checked, with the lossless conversions ints -> float, str -> Path and list -> tuple."""
    inner, optional = strip_optional(tp)
    null_word = from_cli and isinstance(value, str) and value.lower() in NONE_WORDS
    if value is None or (null_word and optional):
        if optional or inner is Any:
            return None
        raise _null_error(path, tp)
    if null_word:  # `--optim.lr none`: "none" may still be a valid str or choice (`--ckpt.resume none`)
        try:
            return _coerce_value(value, tp, path, from_cli)
        except ConfigError:
            raise _null_error(path, tp) from None
    return _coerce_value(value, tp, path, from_cli)


def _null_error(path: str, tp: Any) -> ConfigError:
    """A null (YAML `null` / `~` / empty value, a `none` / `null` flag) for a field that is not Optional."""
    return ConfigError(
        f"null is not allowed for {path} (expected {type_name(tp)}): set a value, or leave the key out to "
        "keep the default",
        field=path,
    )


def _coerce_value(value: Any, tp: Any, path: str, from_cli: bool) -> Any:
    """`coerce` for a value that is not null."""
    inner = strip_optional(tp)[0]
    origin = typing.get_origin(inner)
    if inner is Any:
        return value
    if is_dataclass_type(inner):
        if isinstance(value, inner):
            return value
        if not isinstance(value, Mapping):
            raise _type_error(path, value, inner)
        return from_dict(inner, value, path)
    if origin is Literal:
        choices = typing.get_args(inner)
        for c in choices:
            if value == c or (from_cli and isinstance(value, str) and str(c) == value):
                return c
        raise ConfigError(
            f"{path}: {value!r} is not a valid choice; choose one of: {', '.join(repr(c) for c in choices)}",
            field=path,
        )
    if origin in (typing.Union, types.UnionType):
        for arg in typing.get_args(inner):
            try:
                return coerce(value, arg, path, from_cli=from_cli)
            except ConfigError:
                continue
        raise _type_error(path, value, tp)
    if origin in (list, tuple):
        return _coerce_list(value, inner, path, from_cli)
    if origin is dict:
        if not isinstance(value, Mapping):
            raise _type_error(path, value, tp)
        val_tp = typing.get_args(inner)[1] if typing.get_args(inner) else Any
        return {str(k): coerce(v, val_tp, f"{path}.{k}", from_cli=from_cli) for k, v in value.items()}
    return _coerce_scalar(value, inner, path, from_cli)


def _coerce_list(value: Any, tp: Any, path: str, from_cli: bool) -> Any:
    args = typing.get_args(tp)
    item_tp = args[0] if args else Any
    if from_cli and isinstance(value, str):
        value = [v.strip() for v in value.split(",") if v.strip()] if value else []
    if from_cli and isinstance(value, list) and len(value) == 1 and "," in value[0]:
        value = [v.strip() for v in value[0].split(",") if v.strip()]
    if isinstance(value, str | bytes) or not isinstance(value, Sequence):
        raise _type_error(path, value, tp)
    if typing.get_origin(tp) is tuple and args and args[-1] is not Ellipsis:  # tuple[X, Y]: fixed length
        if len(value) != len(args):
            kinds = ", ".join(type_name(a) for a in args)
            raise ConfigError(
                f"{path}: {list(value)!r} has {len(value)} values; expected {len(args)} ({kinds})", field=path
            )
        return tuple(
            coerce(v, a, f"{path}[{i}]", from_cli=from_cli)
            for i, (v, a) in enumerate(zip(value, args, strict=True))
        )
    items = [coerce(v, item_tp, f"{path}[{i}]", from_cli=from_cli) for i, v in enumerate(value)]
    return tuple(items) if typing.get_origin(tp) is tuple else items


def _coerce_scalar(value: Any, tp: Any, path: str, from_cli: bool) -> Any:
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in TRUE_WORDS + FALSE_WORDS:
            return value.lower() in TRUE_WORDS
        raise ConfigError(f"{path}: {value!r} is not a valid bool; use true or false", field=path)
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if from_cli and isinstance(value, str):
            try:
                return int(value)
            except ValueError:
                pass
        raise _type_error(path, value, tp)
    if tp is float:
        number: float | None = None
        if isinstance(value, int | float) and not isinstance(value, bool):
            number = float(value)
        elif isinstance(value, str):  # YAML reads 1e-5 (no dot) as a string
            with contextlib.suppress(ValueError):
                number = float(value)
        if number is None:
            raise _type_error(path, value, tp)
        if not math.isfinite(number):
            raise ConfigError(f"{path}: {value!r} is not a finite number; give a finite value", field=path)
        return number
    if tp is str:
        if isinstance(value, str):
            return value
        raise _type_error(path, value, tp)
    if tp is Path:
        if isinstance(value, str | Path):
            return Path(value)
        raise _type_error(path, value, tp)
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        for member in tp:
            if value == member or value == member.value or value == member.name:
                return member
        choices = ", ".join(repr(m.value) for m in tp)
        raise ConfigError(f"{path}: {value!r} is not a valid choice; choose one of: {choices}", field=path)
    if isinstance(value, tp):
        return value
    raise _type_error(path, value, tp)


# ---------------------------------------------------------------------------------------------------------
# dict <-> dataclass
# ---------------------------------------------------------------------------------------------------------


def join_path(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def unknown_key_error(cls: type, path: str, key: str, *, option: str | None = None) -> ConfigError:
    """'unknown key' error naming the dotted path, the key, close matches and the valid keys
    (`option`: the whole command-line flag, to word it as an option)."""
    valid = [name for name, _ in config_fields(cls)]
    close = difflib.get_close_matches(key, valid, n=3, cutoff=0.6)
    where = f"'{path}' ({cls.__name__})" if path else cls.__name__
    hint = f" Did you mean: {', '.join(close)}?" if close else ""
    full = join_path(path, key)
    head = f"unknown option --{option}" if option else f"unknown key '{full}'"
    return ConfigError(
        f"{head}: {where} has no field {key!r}.{hint} Valid keys: {', '.join(valid)}", field=full
    )


def from_dict(cls: type[T], data: Mapping[str, Any], path: str = "") -> T:
    """Build `cls` from a (nested) mapping, strictly: unknown keys, wrong types and invalid values raise
    `ConfigError` naming the dotted path. Missing keys take the field defaults."""
    if not isinstance(data, Mapping):
        raise ConfigError(f"{path or 'config'}: expected a mapping for {cls.__name__}, got {data!r}")
    types_ = dict(config_fields(cls))
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        name = str(key).replace("-", "_")
        if name not in types_:
            raise unknown_key_error(cls, path, str(key))
        kwargs[name] = coerce(value, types_[name], join_path(path, name))
    try:
        return cls(**kwargs)
    except ConfigError as e:
        if not path or e.field is None or e.detail is None:
            raise
        full = join_path(path, e.field)
        raise ConfigError(f"{full}: {e.detail}", field=full, detail=e.detail) from None
    except (ValueError, TypeError) as e:
        raise ConfigError(f"{path or cls.__name__}: {e}", field=path or None) from None


def to_dict(cfg: Any) -> dict[str, Any]:
    """A plain nested dict (YAML-safe: enums -> values, paths -> str, tuples -> lists)."""

    def plain(v: Any) -> Any:
        if dataclasses.is_dataclass(v) and not isinstance(v, type):
            return {f.name: plain(getattr(v, f.name)) for f in dataclasses.fields(v) if f.init}
        if isinstance(v, enum.Enum):
            return v.value
        if isinstance(v, Path):
            return str(v)
        if isinstance(v, list | tuple):
            return [plain(x) for x in v]
        if isinstance(v, Mapping):
            return {str(k): plain(x) for k, x in v.items()}
        return v

    return plain(cfg)


def merge(cfg: T, overrides: Mapping[str, Any], path: str = "") -> T:
    """A new config: `cfg` with a nested mapping of overrides applied on top (strict, validated)."""
    base = to_dict(cfg)
    _deep_update(base, overrides)
    return from_dict(type(cfg), base, path)


def _deep_update(base: dict[str, Any], over: Mapping[str, Any]) -> None:
    for k, v in over.items():
        key = str(k).replace("-", "_")
        if isinstance(v, Mapping) and isinstance(base.get(key), dict):
            _deep_update(base[key], v)
        else:
            base[key] = v


def save_yaml(cfg: Any, path: str | Path) -> Path:
    """Write the fully resolved config as YAML (creating parent folders); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False, default_flow_style=False))
    return path


def read_yaml_mapping(path: str | Path) -> dict[str, Any]:
    """The top-level mapping of a YAML file; `ConfigError` when missing, unparsable or not a mapping."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"--config: file not found: {path}")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise ConfigError(f"--config: cannot parse {path} as YAML: {e}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"--config: {path} must hold a mapping of config keys, got {type(data).__name__}")
    return data


def load_yaml(cls: type[T], path: str | Path, default: T | None = None) -> T:
    """Load a YAML config file strictly, on top of `default` (or the class defaults)."""
    data = read_yaml_mapping(path)
    try:
        return merge(default, data) if default is not None else from_dict(cls, data)
    except ConfigError as e:
        raise ConfigError(f"in {path}: {e}", field=e.field) from None


def default_instance(cls: type[T]) -> T:
    """`cls()`, or a ConfigError naming the class when it has required fields."""
    try:
        return cls()
    except TypeError as e:
        raise ConfigError(f"{cls.__name__} has required fields without defaults: {e}") from None
