"""The config machinery on the real components: flags, YAML, precedence, strict errors, --help, round trip."""

from __future__ import annotations

import re
from dataclasses import dataclass, field, is_dataclass
from enum import Enum
from pathlib import Path
from typing import Literal

import pytest

from relayrl.config import (
    CkptConfig,
    ConfigError,
    DataConfig,
    LoggerConfig,
    ModelConfig,
    OptimConfig,
    TrainConfig,
    from_dict,
    invalid,
    load_yaml,
    parse_cli,
    run_command,
    save_yaml,
    to_dict,
)
from relayrl.config import apps as config_apps
from relayrl.config import generate as config_generate
from relayrl.config import recipes as config_recipes
from relayrl.config import rl as config_rl
from relayrl.config.base import config_fields, field_docs, is_dataclass_type, strip_optional


@dataclass(kw_only=True, slots=True)
class Cmd:
    """A command config composed of every component."""

    model: ModelConfig = field(default_factory=ModelConfig)
    """The model."""
    data: DataConfig = field(default_factory=DataConfig)
    """The data."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """The optimizer."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """The loop."""
    ckpt: CkptConfig = field(default_factory=CkptConfig)
    """Checkpoints."""
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    """Logging."""
    mode: Literal["response", "multiturn", "pretrain"] = "response"
    """Which tokens carry the loss."""
    note: str | None = None
    """An optional note."""


def test_dotted_overrides_all_value_kinds():
    cfg = parse_cli(
        Cmd,
        [
            "--optim.lr", "3e-4",
            "--optim.warmup_steps=7",
            "--train.packing",  # bare bool flag = true
            "--logger.progress_bar", "false",
            "--data.datasets", "a.jsonl", "b.jsonl",
            "--data.dataset_probs=0.25,0.75",
            "--model.lora.rank", "8",
            "--optim.adam_betas", "0.8", "0.9",
            "--mode", "pretrain",
            "--note", "hi",
        ],
    )  # fmt: skip
    assert cfg.optim.lr == 3e-4 and cfg.optim.warmup_steps == 7
    assert cfg.train.packing is True and cfg.logger.progress_bar is False
    assert cfg.data.datasets == ["a.jsonl", "b.jsonl"] and cfg.data.dataset_probs == [0.25, 0.75]
    assert cfg.model.lora.rank == 8 and cfg.optim.adam_betas == (0.8, 0.9)
    assert cfg.mode == "pretrain" and cfg.note == "hi"
    # untouched fields keep their defaults
    assert cfg.optim.scheduler == "cosine" and cfg.train.batch_size == 64
    assert parse_cli(Cmd, ["--note", "none"]).note is None


def test_yaml_then_cli_precedence(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("optim:\n  lr: 1e-3\n  scheduler: linear\ntrain:\n  seed: 5\n  batch_size: 16\n")
    cfg = parse_cli(Cmd, ["--optim.lr", "2e-5", "--config", str(path)])
    assert cfg.optim.lr == 2e-5  # the flag wins over the file, wherever it appears
    assert cfg.optim.scheduler == "linear" and cfg.train.seed == 5 and cfg.train.batch_size == 16
    assert cfg.train.micro_batch_size == 8  # default under both


def test_preset_default_then_yaml_then_cli(tmp_path):
    def tiny_preset() -> Cmd:
        return Cmd(optim=OptimConfig(lr=1e-3, warmup_steps=3), train=TrainConfig(seed=1))

    path = tmp_path / "run.yaml"
    path.write_text("train: {seed: 9}\n")
    cfg = parse_cli(Cmd, ["--config", str(path), "--optim.warmup_steps", "4"], default=tiny_preset())
    assert (cfg.optim.lr, cfg.optim.warmup_steps, cfg.train.seed) == (1e-3, 4, 9)
    named = parse_cli(Cmd, ["--preset", "tiny"], presets={"tiny": tiny_preset})
    assert named.optim.lr == 1e-3
    with pytest.raises(ConfigError, match=r"'big' is not a preset; choose one of: tiny"):
        parse_cli(Cmd, ["--preset", "big"], presets={"tiny": tiny_preset})


def test_unknown_cli_key_names_path_and_suggestions():
    with pytest.raises(ConfigError) as e:
        parse_cli(Cmd, ["--optim.lrr", "1e-4"])
    msg = str(e.value)
    assert "--optim.lrr" in msg and "'lrr'" in msg and "Did you mean: lr?" in msg
    assert "Valid keys: lr, weight_decay, adam_betas" in msg
    with pytest.raises(ConfigError, match=r"--trian.seed: Cmd has no field 'trian'. Did you mean: train\?"):
        parse_cli(Cmd, ["--trian.seed", "1"])


def test_unknown_yaml_key_names_file_path_and_suggestions(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("model:\n  lora:\n    rnak: 4\n")
    with pytest.raises(ConfigError) as e:
        parse_cli(Cmd, ["--config", str(path)])
    msg = str(e.value)
    assert str(path) in msg and "unknown key 'model.lora.rnak'" in msg and "Did you mean: rank?" in msg
    assert "Valid keys: rank, alpha, dropout, target_modules" in msg


def test_wrong_type_names_field_value_and_type(tmp_path):
    with pytest.raises(ConfigError, match=r"^optim.lr: 'abc' is not a valid float$"):
        parse_cli(Cmd, ["--optim.lr", "abc"])
    with pytest.raises(ConfigError, match=r"train.seed: '1.5' is not a valid int"):
        parse_cli(Cmd, ["--train.seed", "1.5"])
    with pytest.raises(ConfigError, match=r"train.packing: 'maybe' is not a valid bool; use true or false"):
        parse_cli(Cmd, ["--train.packing", "maybe"])
    path = tmp_path / "t.yaml"
    path.write_text("train:\n  epochs: three\n")
    with pytest.raises(ConfigError, match=r"train.epochs: 'three' is not a valid int"):
        parse_cli(Cmd, ["--config", str(path)])
    with pytest.raises(ConfigError, match=r"--optim.lr expects a value \(float\)"):
        parse_cli(Cmd, ["--optim.lr"])
    with pytest.raises(
        ConfigError, match=r"--model is a group of options; set its fields: --model.name_or_path"
    ):
        parse_cli(Cmd, ["--model", "x"])


def test_null_for_a_field_that_is_not_optional_says_null_not_missing(tmp_path):
    # no config field is required: a key left out keeps its default (model.name_or_path, "required by
    # commands that load one", is checked when the model is loaded: "model.name_or_path is empty")
    (tmp_path / "left_out.yaml").write_text("optim:\n  warmup_steps: 3\n")
    assert parse_cli(Cmd, ["--config", str(tmp_path / "left_out.yaml")]).optim.lr == OptimConfig().lr
    null = r"null is not allowed for optim\.lr \(expected float\): set a value, or leave the key out"
    for word in ("none", "null", "None", "~"):
        with pytest.raises(ConfigError, match=rf"^{null}"):
            parse_cli(Cmd, ["--optim.lr", word])
    for text in ("optim: {lr: null}\n", "optim:\n  lr: ~\n", "optim:\n  lr:\n"):
        (tmp_path / "null.yaml").write_text(text)
        with pytest.raises(ConfigError, match=rf"^in {tmp_path / 'null.yaml'}: {null}"):
            parse_cli(Cmd, ["--config", str(tmp_path / "null.yaml")])
    with pytest.raises(ConfigError, match=r"^null is not allowed for train\.seed \(expected int\)"):
        from_dict(Cmd, {"train": {"seed": None}})
    with pytest.raises(
        ConfigError, match=r"^null is not allowed for optim \(expected a OptimConfig mapping\)"
    ):
        from_dict(Cmd, {"optim": None})
    # an Optional field takes null; "none" stays a value where the type accepts it
    cfg = parse_cli(Cmd, ["--note", "none", "--ckpt.resume", "none", "--model.name_or_path", "none"])
    assert cfg.note is None and cfg.ckpt.resume == "none" and cfg.model.name_or_path == "none"


def test_invalid_values_name_field_value_and_range():
    with pytest.raises(ConfigError, match=r"^optim.lr: -1.0 is invalid; expected a float > 0$"):
        parse_cli(Cmd, ["--optim.lr", "-1"])
    with pytest.raises(
        ConfigError, match=r"^model.lora.dropout: 1.5 is invalid; expected a float in \[0, 1\)$"
    ):
        parse_cli(Cmd, ["--model.lora.dropout", "1.5"])
    with pytest.raises(
        ConfigError, match=r"train.batch_size: 10 is invalid; expected a multiple of micro_batch_size \(4\)"
    ):
        parse_cli(Cmd, ["--train.micro_batch_size", "4", "--train.batch_size", "10"])
    with pytest.raises(ConfigError, match=r"data.dataset_probs: .*one probability per source \(1 sources"):
        parse_cli(Cmd, ["--data.datasets", "a.jsonl", "--data.dataset_probs", "0.5", "0.5"])
    # direct construction in Python checks too, naming the field
    with pytest.raises(ConfigError, match=r"^lr: 0.0 is invalid"):
        OptimConfig(lr=0.0)
    assert str(invalid("x", 3, "an even int")) == "x: 3 is invalid; expected an even int"


def test_literal_choices_listed():
    with pytest.raises(ConfigError) as e:
        parse_cli(Cmd, ["--optim.scheduler", "cos"])
    assert (
        str(e.value)
        == "optim.scheduler: 'cos' is not a valid choice; choose one of: 'cosine', 'linear', 'constant'"
    )
    with pytest.raises(
        ConfigError,
        match=r"model.dtype: 'float32' is not a valid choice; choose one of: 'auto', 'fp32', 'bf16', 'fp16'",
    ):
        from_dict(Cmd, {"model": {"dtype": "float32"}})
    with pytest.raises(
        ConfigError, match=r"^dtype: 'int8' is invalid; expected one of 'auto', 'fp32', 'bf16', 'fp16'$"
    ):
        ModelConfig(dtype="int8")  # type: ignore[arg-type]


def test_help_lists_groups_docstrings_and_defaults(capsys):
    with pytest.raises(SystemExit) as e:
        parse_cli(Cmd, ["--optim.lr", "1", "--help"], prog="relayrl sft")
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: relayrl sft")
    assert "model.lora: LoRA adapters through peft" in out
    assert "--optim.lr FLOAT  (default: 1e-05)" in out and "Peak learning rate." in out
    assert "--optim.scheduler {cosine,linear,constant}  (default: cosine)" in out
    assert "--data.datasets STR [...]  (default: [])" in out
    # every field of every component has a docstring, and all of them are in --help
    for comp in (ModelConfig, DataConfig, OptimConfig, TrainConfig, CkptConfig, LoggerConfig):
        docs = field_docs(comp)
        for name in comp.__dataclass_fields__:
            assert docs.get(name), f"{comp.__name__}.{name} has no docstring"
            if name != "lora":
                assert docs[name].split()[0] in out


def test_yaml_round_trip(tmp_path):
    cfg = parse_cli(Cmd, ["--optim.adam_betas", "0.8,0.99", "--data.datasets", "x.jsonl", "--note", "n"])
    path = save_yaml(cfg, tmp_path / "run" / "config.yaml")
    back = load_yaml(Cmd, path)
    assert back == cfg and to_dict(back) == to_dict(cfg)
    assert "adam_betas:\n  - 0.8\n  - 0.99" in path.read_text()


def test_run_command_exit_codes(capsys):
    seen = []
    assert run_command(Cmd, ["--train.seed", "3"], "relayrl x", lambda c: seen.append(c.train.seed)) == 0
    assert seen == [3]
    assert run_command(Cmd, ["--train.sed", "3"], "relayrl x", lambda c: seen.append(1)) == 2
    err = capsys.readouterr().err
    assert "relayrl x: error: unknown option --train.sed" in err and "Did you mean: seed?" in err
    assert seen == [3]  # no work started
    assert run_command(Cmd, ["-h"], "relayrl x", lambda c: 7) == 0
    assert run_command(Cmd, [], "relayrl x", lambda c: 7) == 7


class Color(Enum):
    RED = "red"
    BLUE = "blue"


@dataclass(kw_only=True, slots=True)
class Inner:
    """An optional nested group."""

    k: int = 1
    """A number."""


@dataclass(kw_only=True, slots=True)
class Generic:
    """Not a relayrl component: the machinery is generic over any dataclass tree."""

    color: Color = Color.RED
    """An enum."""
    path: Path = Path("out")
    """A path."""
    weights: dict[str, float] = field(default_factory=dict)
    """A mapping."""
    size: int | str = 3
    """A union."""
    inner: Inner | None = None
    """Off unless set."""


def test_generic_tree_enum_path_dict_union_optional_group(tmp_path):
    cfg = parse_cli(Generic, ["--color", "blue", "--path", "a/b", "--size", "big", "--inner.k", "5"])
    assert cfg.color is Color.BLUE and cfg.path == Path("a/b") and cfg.size == "big"
    assert cfg.inner == Inner(k=5)  # setting a field of an absent optional group creates it
    assert parse_cli(Generic, ["--size", "7"]).size == 7 and parse_cli(Generic, []).inner is None
    with pytest.raises(
        ConfigError, match=r"^color: 'green' is not a valid choice; choose one of: 'red', 'blue'$"
    ):
        parse_cli(Generic, ["--color", "green"])
    (tmp_path / "g.yaml").write_text("weights: {a: 1, b: 0.5}\ninner: {k: 2}\n")
    cfg = parse_cli(Generic, ["--config", str(tmp_path / "g.yaml")])
    assert cfg.weights == {"a": 1.0, "b": 0.5} and cfg.inner == Inner(k=2)
    assert load_yaml(Generic, save_yaml(cfg, tmp_path / "back.yaml")) == cfg
    with pytest.raises(ConfigError, match=r"weights.b: 'x' is not a valid float"):
        from_dict(Generic, {"weights": {"b": "x"}})


@dataclass(kw_only=True, slots=True)
class Pair:
    """A fixed-length tuple of two types."""

    point: tuple[int, str] = (1, "a")
    """An int and a str."""


def test_fixed_length_tuple_checks_length_and_each_type():
    assert parse_cli(Pair, ["--point", "3", "b"]).point == (3, "b")
    assert from_dict(Pair, {"point": [4, "c"]}).point == (4, "c")
    with pytest.raises(ConfigError, match=r"^point: \['3'\] has 1 values; expected 2 \(int, str\)$"):
        parse_cli(Pair, ["--point", "3"])
    with pytest.raises(ConfigError, match=r"^point: \[1, 'a', 2\] has 3 values; expected 2 \(int, str\)$"):
        from_dict(Pair, {"point": [1, "a", 2]})
    with pytest.raises(ConfigError, match=r"^point\[0\]: 'x' is not a valid int$"):
        parse_cli(Pair, ["--point", "x", "y"])


def _command_configs() -> list[type]:
    """Every top-level command config (a dataclass of relayrl.config with a `dist` section)."""
    out = []
    for mod in (config_apps, config_generate, config_recipes, config_rl):
        for obj in vars(mod).values():
            if isinstance(obj, type) and is_dataclass(obj) and obj.__module__ == mod.__name__:
                out.append(obj)
    return out


def _float_paths(cls: type, prefix: str = "") -> list[str]:
    """Dotted paths of every float field (plain, optional, list / tuple of floats) under dataclass `cls`."""
    paths = []
    for name, tp in config_fields(cls):
        inner, _ = strip_optional(tp)
        path = f"{prefix}{name}"
        if is_dataclass_type(inner):
            paths += _float_paths(inner, path + ".")
        elif inner is float or float in getattr(inner, "__args__", ()):
            paths.append(path)
    return paths


def _nested(path: str, value):
    out = value
    for key in reversed(path.split(".")):
        out = {key: out}
    return out


@pytest.mark.parametrize("bad", ["nan", "inf", "-inf", float("nan"), float("inf")])
def test_every_float_field_of_every_config_refuses_non_finite(bad):
    # --optim.lr inf / --optim.weight_decay nan trained to NaN weights and exported them; now every float
    # field of every section of every command is refused from flags and YAML, naming its dotted path
    checked = 0
    for cls in _command_configs():
        for path in _float_paths(cls):
            value = [bad, bad] if _is_list_field(cls, path) else bad
            with pytest.raises(ConfigError, match=rf"{re.escape(path)}(\[0\])?: .*finite") as e:
                from_dict(cls, _nested(path, value))
            assert e.value.field is not None, (cls, path)
            checked += 1
    assert checked > 60  # optim.lr, optim.weight_decay, optim.max_grad_norm, algo.*, rollout.*, kd.* ...


def _is_list_field(cls: type, path: str) -> bool:
    *parents, last = path.split(".")
    for p in parents:
        cls = strip_optional(dict(config_fields(cls))[p])[0]
    tp = strip_optional(dict(config_fields(cls))[last])[0]
    return getattr(tp, "__origin__", None) in (list, tuple)


def test_non_finite_floats_refused_in_python_construction():
    with pytest.raises(ConfigError, match=r"lr: inf is invalid; expected a finite number"):
        OptimConfig(lr=float("inf"))
    with pytest.raises(ConfigError, match=r"adam_betas\[1\]: nan is invalid"):
        OptimConfig(adam_betas=(0.9, float("nan")))
    # a section without its own checks (AlgoConfig) is caught by the command that holds it
    algo = config_rl.AlgoConfig(kl_coef=float("nan"))
    with pytest.raises(ConfigError, match=r"algo.kl_coef: nan is invalid; expected a finite number"):
        config_rl.RLConfig(algo=algo)
