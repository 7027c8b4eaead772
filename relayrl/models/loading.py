"""Load policies, reference models and tokenizers; LoRA / QLoRA through peft; merge adapters.

    tok = load_tokenizer("path/or/hub-id")                       pad token falls back to eos (with a warning)
    model = load_causal_lm(ModelConfig(name_or_path=...))        dtype, attention kernel, grad checkpointing,
                                                                 LoRA (lora.rank > 0), QLoRA (load_in_4bit)
    device = resolve_device("auto")                              the ONE device rule (cuda when available)

Errors teach: a name that is neither a local folder nor reachable on the Hub (offline) says so and how to fix
it; QLoRA without bitsandbytes or without CUDA names what is missing. Value-head models (critic / reward
model) live in value_head.py and reuse `resolve_source`, `torch_dtype` and `apply_lora`; merging an adapter
(merge_lora) is merge.py, above both.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any, Protocol, cast

import torch

from relayrl.config.components import LoraConfig, ModelConfig
from relayrl.data.loading import hub_offline_reason
from relayrl.models import vlm
from relayrl.models.moe import install_moe

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class Pretrained(Protocol):
    """What relayrl uses of a Hugging Face (or PEFT-wrapped) model beyond `torch.nn.Module`."""

    config: Any

    def save_pretrained(self, save_directory: Any, /, *args: Any, **kwargs: Any) -> Any: ...


def pretrained(model: torch.nn.Module) -> Pretrained:
    """The HF side of a model that is typed as a `torch.nn.Module` (torch's type does not declare
    `save_pretrained` / `config`; every model relayrl loads is an HF or PEFT model)."""
    return cast(Pretrained, model)


def torch_dtype(name: str, device: torch.device | str | None = None) -> torch.dtype:
    """ "fp32" / "bf16" / "fp16" -> the torch dtype; "auto" -> bf16 for a model placed on a CUDA device, else
    fp32 (a CPU model stays fp32 on a machine that also has a GPU)."""
    if name == "auto":
        return torch.bfloat16 if device is not None and torch.device(device).type == "cuda" else torch.float32
    if name not in DTYPES:
        raise ValueError(f"model.dtype must be one of {list(DTYPES)}, got {name!r}")
    return DTYPES[name]


def resolve_device(name: str | None, what: str = "train.device") -> torch.device:
    """ "auto" (or "" / None) -> cuda when available else cpu; "cuda" without a GPU is an error naming the
    field `what` and the fix."""
    if not name or name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise RuntimeError(f"{what}={name} but no CUDA device is available; use --{what} cpu or auto")
    return torch.device(name)


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes")


def resolve_source(name_or_path: str, what: str = "model.name_or_path") -> str:
    """Check that `name_or_path` is a local folder or a Hub id we may download; return it (a local folder made
    absolute; a Hub id unchanged, or its local Hub-cache folder when the Hub cannot be reached).

    Raises a clear error at once for an empty value, a local-looking path that does not exist, or a Hub id
    that is not in the local Hub cache while HF_HUB_OFFLINE=1 or while the Hub does not answer
    (relayrl.data.loading.hub_offline_reason: one connection attempt, a few seconds at most).
    """
    if not name_or_path:
        raise ValueError(
            f"{what} is empty: pass a local model folder or a Hub id (e.g. --{what} Qwen/Qwen3-0.6B)"
        )
    p = Path(name_or_path).expanduser()
    if p.is_dir():
        return str(p.resolve())  # absolute: adapters saved from it name a base that loads from any folder
    looks_local = name_or_path.startswith((".", "/", "~")) or name_or_path.count("/") > 1 or p.exists()
    if looks_local:
        raise FileNotFoundError(f"{what}={name_or_path!r}: no such folder (expected an HF model folder)")
    reason = hub_offline_reason()  # offline env vars, or no answer from HF_ENDPOINT within a few seconds
    if reason is None:
        return name_or_path
    cached = _cached_snapshot(name_or_path)
    if cached is not None:  # HF_HUB_OFFLINE: transformers reads its cache itself; else the cached folder
        return name_or_path if _offline() else cached
    if _offline():
        raise OSError(
            f"{what}={name_or_path!r} is not a local folder and HF_HUB_OFFLINE=1 forbids downloading it: "
            "pass a local folder, or unset HF_HUB_OFFLINE where the Hub is reachable"
        )
    raise OSError(
        f"{what}={name_or_path!r} is not a local folder and the Hugging Face Hub cannot be used ({reason}): "
        "pass a local model folder, or check the network (HF_ENDPOINT, proxy settings); fails at once instead "
        "of after a minute of download retries"
    )


def _cached_snapshot(repo_id: str) -> str | None:
    """The local Hub-cache folder of `repo_id` when it holds the repo's config (model or adapter), else None."""
    from huggingface_hub import try_to_load_from_cache

    for name in ("config.json", "adapter_config.json"):
        hit = try_to_load_from_cache(repo_id, name)
        if isinstance(hit, str):
            return str(Path(hit).parent)
    return None


def hub_error(err: Exception, source: str, what: str) -> OSError:
    return OSError(
        f"could not load {what}={source!r}: {err}. If it is a Hub id, check the name and that the Hub is "
        "reachable (offline machines need a local folder)"
    )


TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "spiece.model",
    "merges.txt",
)
"""Files of which a local model folder needs at least one to provide its tokenizer."""


def load_tokenizer(
    name_or_path: str,
    *,
    trust_remote_code: bool = False,
    padding_side: str | None = None,
    what: str = "model.tokenizer_name_or_path",
) -> Any:
    """AutoTokenizer from a folder or Hub id; sets pad_token = eos_token (with a warning) when missing.
    `what`: the config field errors name (model.name_or_path when the tokenizer comes from the model's)."""
    from transformers import AutoTokenizer

    source = resolve_source(name_or_path, what)
    folder = Path(source)
    if folder.is_dir() and not any((folder / f).is_file() for f in TOKENIZER_FILES):
        raise ValueError(
            f"{folder} has no tokenizer files ({', '.join(TOKENIZER_FILES[:3])}, ...): set "
            "--model.tokenizer_name_or_path to the folder or Hub id of the model's tokenizer (or save the "
            "tokenizer into this folder with tokenizer.save_pretrained)"
        )
    try:
        tok = AutoTokenizer.from_pretrained(source, trust_remote_code=trust_remote_code)
    except OSError as err:
        raise hub_error(err, source, "tokenizer") from err
    if tok.pad_token is None:
        if tok.eos_token is None:
            raise ValueError(f"tokenizer {source!r} has neither a pad token nor an eos token; set one in it")
        warnings.warn(
            f"tokenizer {source!r} has no pad token; using eos {tok.eos_token!r} as pad", stacklevel=2
        )
        tok.pad_token = tok.eos_token
    if padding_side is not None:
        tok.padding_side = padding_side
    return vlm.keep_image_processor(tok, folder) if folder.is_dir() else tok


def quantization_config(cfg: ModelConfig) -> Any:
    """BitsAndBytesConfig for QLoRA (nf4, double quant, bf16 compute); None when load_in_4bit is off."""
    if not cfg.load_in_4bit:
        return None
    missing = []
    try:
        import bitsandbytes  # noqa: F401  # pyright: ignore[reportMissingImports]
    except ImportError:
        missing.append("the bitsandbytes package (pip install bitsandbytes)")
    if not torch.cuda.is_available():
        missing.append("a CUDA GPU")
    if missing:
        raise RuntimeError(
            f"model.load_in_4bit (QLoRA) needs {' and '.join(missing)}; turn load_in_4bit off to use plain LoRA"
        )
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.bfloat16,
    )


def model_kwargs(cfg: ModelConfig, device: torch.device | str | None = None) -> dict[str, Any]:
    """from_pretrained keyword arguments shared by causal LMs and value-head models (`device`: where the model
    will live, for dtype auto)."""
    kwargs: dict[str, Any] = {
        "dtype": torch_dtype(cfg.dtype, device),
        "attn_implementation": cfg.attn_implementation,
        "trust_remote_code": cfg.trust_remote_code,
    }
    quant = quantization_config(cfg)
    if quant is not None:
        kwargs["quantization_config"] = quant
        kwargs["device_map"] = {"": torch.cuda.current_device()}
    return kwargs


def apply_lora(model: Any, lora: LoraConfig, *, task_type: str = "CAUSAL_LM", quantized: bool = False) -> Any:
    """Wrap `model` in peft LoRA adapters (rank, alpha, dropout, targets); returns the PeftModel.

    task_type "SEQ_CLS" (value-head models) also trains and saves the `score` head.
    """
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model, prepare_model_for_kbit_training

    if quantized:
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    targets: Any = lora.target_modules
    if targets == ["all-linear"]:
        targets = "all-linear"
    peft_cfg = PeftLoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=targets,
        task_type=task_type,
        modules_to_save=["score"] if task_type == "SEQ_CLS" else None,
    )
    return get_peft_model(model, peft_cfg)


def finish_model(model: Any, cfg: ModelConfig, *, task_type: str) -> Any:
    """Gradient checkpointing and LoRA, shared by causal LMs and value-head models."""
    if cfg.gradient_checkpointing:
        # newer transformers 5 name; 5.17 (the GPU machine) only has gradient_checkpointing_enable
        enable = getattr(model, "activation_checkpointing_enable", None)
        if enable is not None:
            enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
    if cfg.lora.rank > 0:
        model = apply_lora(model, cfg.lora, task_type=task_type, quantized=cfg.load_in_4bit)
        if cfg.gradient_checkpointing:
            model.enable_input_require_grads()
    return model


def checkpointing_enabled(model: Any) -> bool:
    """Whether activation (gradient) checkpointing is on: any module's `gradient_checkpointing` flag.

    transformers 5.17 names the property `is_gradient_checkpointing`, 5.24 `is_activation_checkpointing`
    (the old name warns); both read these flags, which peft wrappers also expose through `modules()`.
    """
    return any(getattr(m, "gradient_checkpointing", False) is True for m in model.modules())


def load_pretrained(
    auto_cls: Any,
    name_or_path: str,
    *,
    what: str = "model.name_or_path",
    device: torch.device | str | None = None,
    **kwargs: Any,
) -> Any:
    """`auto_cls.from_pretrained(source, **kwargs)` (a transformers Auto class) of a checked source
    (`resolve_source`; errors name `what` and the fix), moved to `device` when given unless quantized
    (bitsandbytes places a quantized model itself). The one HF model-loading path."""
    source = resolve_source(name_or_path, what)
    try:
        model = auto_cls.from_pretrained(source, **kwargs)
    except OSError as err:
        raise hub_error(err, source, what) from err
    if device is not None and kwargs.get("quantization_config") is None:
        model = model.to(device)
    install_moe(model)  # sparse MoE blocks: fp32 routing, routing replay, aux loss (models/moe.py)
    return model


def load_causal_lm(cfg: ModelConfig, *, device: torch.device | str | None = None, lora: bool = True) -> Any:
    """AutoModelForCausalLM per `cfg`: dtype, attention kernel, gradient checkpointing, LoRA / QLoRA.

    `lora=False` skips adapters (e.g. for a frozen reference model). The model is moved to `device` unless
    it was quantized (bitsandbytes places it itself).
    """
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    auto = AutoModelForImageTextToText if vlm.is_vlm_folder(cfg.name_or_path) else AutoModelForCausalLM
    model = load_pretrained(auto, cfg.name_or_path, device=device, **model_kwargs(cfg, device))
    vlm.prepare_vlm(model, train_vision=not cfg.freeze_vision_tower)
    if not lora:
        return model
    return finish_model(model, cfg, task_type="CAUSAL_LM")


def load_model_and_tokenizer(
    cfg: ModelConfig, *, device: torch.device | str | None = None
) -> tuple[Any, Any]:
    """(causal LM, tokenizer) per `cfg`; the tokenizer from tokenizer_name_or_path or name_or_path."""
    tok = load_tokenizer(
        cfg.tokenizer_name_or_path or cfg.name_or_path, trust_remote_code=cfg.trust_remote_code
    )
    return load_causal_lm(cfg, device=device), tok
