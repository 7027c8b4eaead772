"""Value-head models for critics (per-token values) and reward models (one score per sequence).

A value-head model IS a Hugging Face `AutoModelForSequenceClassification` with num_labels=1: the decoder
(`model.<base_model_prefix>`) plus a linear head named `score` (hidden -> 1, no bias), with `pad_token_id` in
its config. So a saved critic / RM folder loads anywhere with

    AutoModelForSequenceClassification.from_pretrained(folder)     # logits [B, 1] = sequence_scores(...)

and vLLM / OpenRLHF-style tools read it unchanged. The exception: a vision-language model has no such class, so
its critic is the VLM with the same `score` head attached (relayrl.models.vlm_value; docs/vlm.md).

    rm = build_value_model(ModelConfig(name_or_path=sft_path), init="normal")   # new head on a causal LM
    v  = head_values(critic, hidden)                         # [...]    THE value head on hidden states [..., H]
    v  = padded_values(critic, input_ids, attention_mask)    # [B, T]   value of every position of padded rows
    r  = sequence_scores(rm, input_ids, attention_mask)      # [B]      RM: value at the last real token
    save_value_model(rm, tokenizer, out_dir)

Every value-head forward applies the head through `head_values`: padded rows here (left or right padding,
an attention mask: HF's own convention), packed or length-bucketed sequences in
relayrl.models.forward.token_values (the trainers' and the critic's), the local reward model
(relayrl.agents.rewards.local_rm) through `sequence_scores`. The saved folder's own HF pooling gives the
same scores (the same op order: head on every position, then the last real one).

`build_value_model` accepts either a causal-LM folder (the head is new: zeros for a critic, N(0, 1/(H+1)) for
a reward model as in OpenRLHF) or an already saved value-head folder (the head is loaded). Packed inputs work
as for causal LMs: pass position_ids and attention_mask=None.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch

from relayrl.config.components import ModelConfig
from relayrl.models.loading import finish_model, hub_error, model_kwargs, resolve_source
from relayrl.models.vlm import is_vlm_folder
from relayrl.models.vlm_value import build_vlm_value_model


def _is_value_folder(source: str) -> bool:
    config = Path(source) / "config.json"
    if not config.is_file():
        return False
    archs = json.loads(config.read_text()).get("architectures") or []
    return any(a.endswith("ForSequenceClassification") for a in archs)


def build_value_model(
    cfg: ModelConfig,
    *,
    init: str = "zeros",
    pad_token_id: int | None = None,
    device: torch.device | str | None = None,
) -> Any:
    """An `AutoModelForSequenceClassification` (num_labels=1) from a causal-LM or value-head folder.

    init: how a NEW head is initialised: "zeros" (critic: starts at V=0) or "normal" (reward model,
    std 1/sqrt(H+1)); ignored when loading a saved value-head folder. pad_token_id defaults to the one in
    the model config (needed by HF's own pooling; set it from the tokenizer when the config lacks it).
    LoRA (cfg.lora.rank > 0) uses peft task SEQ_CLS, which also trains the `score` head. A vision-language
    model folder gives the VLM with a `score` head attached (relayrl.models.vlm_value).
    """
    from transformers import AutoConfig, AutoModelForSequenceClassification

    if init not in ("zeros", "normal"):
        raise ValueError(f"value head init must be 'zeros' or 'normal', got {init!r}")
    source = resolve_source(cfg.name_or_path)
    if is_vlm_folder(source):  # no ForSequenceClassification class: the VLM + a `score` head
        return build_vlm_value_model(cfg, source, init=init, pad_token_id=pad_token_id, device=device)
    existing = _is_value_folder(source)
    kwargs = model_kwargs(cfg, device)
    try:
        hf_config = AutoConfig.from_pretrained(source, trust_remote_code=cfg.trust_remote_code)
        hf_config.num_labels = 1
        if pad_token_id is not None:
            hf_config.pad_token_id = pad_token_id
        model = AutoModelForSequenceClassification.from_pretrained(source, config=hf_config, **kwargs)
    except OSError as err:
        raise hub_error(err, source, "model.name_or_path") from err
    except ValueError as err:
        raise ValueError(
            f"{source!r}: this architecture has no ForSequenceClassification class in transformers, so it "
            f"cannot carry a value head ({err})"
        ) from err
    if not existing:
        _init_head(model.score, init)
    if device is not None and not cfg.load_in_4bit:
        model = model.to(device)
    return finish_model(model, cfg, task_type="SEQ_CLS")


@torch.no_grad()
def _init_head(head: torch.nn.Linear, init: str) -> None:
    if init == "zeros":
        head.weight.zero_()
    else:
        head.weight.normal_(0.0, 1.0 / math.sqrt(head.in_features + 1))
    if head.bias is not None:
        head.bias.zero_()


def _unwrap(model: Any) -> Any:
    """The HF model under a peft wrapper (peft keeps `score` trainable through modules_to_save)."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def head_values(model: Any, hidden: torch.Tensor) -> torch.Tensor:
    """The value head (`score`, hidden -> 1) on hidden states [..., H] -> values [...] float32 (the model
    under a peft wrapper: peft keeps `score` trainable through modules_to_save)."""
    return _unwrap(model).score(hidden).squeeze(-1).float()


def padded_hidden(
    model: Any,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """The decoder trunk's last hidden states [B, T, H] of padded rows (`attention_mask` marks real tokens)."""
    hf = _unwrap(model)
    decoder = getattr(hf, hf.base_model_prefix)
    return decoder(
        input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
    ).last_hidden_state


def padded_values(
    model: Any,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-token values [B, T] (float32): the `score` head applied to every position's last hidden state."""
    return head_values(model, padded_hidden(model, input_ids, attention_mask, position_ids))


def last_token_index(attention_mask: torch.Tensor) -> torch.Tensor:
    """[B] index of the last real (mask=1) position of each row; works for left and right padding."""
    positions = torch.arange(attention_mask.shape[-1], device=attention_mask.device)
    return (positions * attention_mask.to(positions.dtype)).argmax(-1)


def sequence_scores(
    model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Reward-model scores [B] (float32): the value at each row's last real token (the head runs on every
    position and the last real one is gathered, in the order of HF's own sequence-classification pooling)."""
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    values = padded_values(model, input_ids, attention_mask)
    return values.gather(1, last_token_index(attention_mask)[:, None]).squeeze(1)


def save_value_model(model: Any, tokenizer: Any, out_dir: str | Path, *, merge_lora: bool = True) -> Path:
    """Save so that `AutoModelForSequenceClassification.from_pretrained(out_dir)` loads it.

    A peft model is merged first (merge_lora=True) so the folder is a plain full model; pad_token_id is
    taken from the tokenizer when the config lacks it.
    """
    out_dir = Path(out_dir)
    if merge_lora and hasattr(model, "merge_and_unload"):
        model = model.merge_and_unload()
    if getattr(model.config, "pad_token_id", None) is None and tokenizer is not None:
        model.config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out_dir)
    if tokenizer is not None:
        tokenizer.save_pretrained(out_dir)
    return out_dir


REWARD_STATS = ("reward_mean", "reward_std")
"""Keys of a reward model's score statistics over its training pairs (written by `relayrl rm`)."""
STATS_FILE = "reward_stats.json"
"""Where they are kept beside the weights (also in config.json when the folder has one: not a LoRA adapter)."""


def write_reward_stats(folder: str | Path, mean: float, std: float) -> None:
    """reward_mean / reward_std into the folder's reward_stats.json and config.json (when present)."""
    values = dict(zip(REWARD_STATS, (float(mean), float(std)), strict=True))
    (Path(folder) / STATS_FILE).write_text(json.dumps(values, indent=2) + "\n")
    path = Path(folder) / "config.json"
    if path.is_file():
        config = json.loads(path.read_text())
        config.update(values)
        path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def reward_stats(folder: str | Path) -> tuple[float, float] | None:
    """(mean, std) from a reward model folder (config.json, else reward_stats.json), None when absent."""
    for name in ("config.json", STATS_FILE):
        path = Path(folder) / name
        if path.is_file():
            data = json.loads(path.read_text())
            if all(k in data for k in REWARD_STATS):
                return float(data["reward_mean"]), float(data["reward_std"])
    return None
