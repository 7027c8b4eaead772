"""Value-head models of vision-language models (PPO critics of a VLM policy; docs/vlm.md).

transformers has no sequence-classification class for Qwen2-VL-shaped models, so a VLM critic is the VLM itself
(`AutoModelForImageTextToText`: vision tower + decoder trunk) with relayrl's value head attached as `score`
(hidden -> 1, no bias), the same attribute relayrl.models.value_head's functions apply (`head_values`):

    critic = build_vlm_value_model(cfg, source, init="zeros", pad_token_id=tok.pad_token_id)
    with images_for(images):                           # the image hook (relayrl.models.vlm) adds each row's
        v = forward.token_values(critic, seqs, layout)  # pixels to the trunk: values depend on the picture

The vision tower is frozen unless `model.freeze_vision_tower` is off (as for the policy); the lm_head is kept
(tied to the embeddings in small models) but never used, so it gets no gradient. The saved folder is the VLM's
own (its config and processor files) plus `score.weight` in its safetensors: `build_vlm_value_model` on that
folder loads the head back (transformers itself drops the key as unexpected).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from relayrl.config.components import ModelConfig
from relayrl.models.loading import finish_model, load_pretrained, model_kwargs
from relayrl.models.vlm import prepare_vlm

HEAD_KEY = "score.weight"
"""The value head's weight in a saved VLM value folder's safetensors."""


def saved_head(source: str | Path) -> torch.Tensor | None:
    """The saved value head's weight [1, H] of a VLM folder, None when the folder has none (a plain VLM)."""
    from safetensors import safe_open

    for file in sorted(Path(source).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            if HEAD_KEY in f.keys():  # noqa: SIM118 (safe_open has no __contains__)
                return f.get_tensor(HEAD_KEY)
    return None


def build_vlm_value_model(
    cfg: ModelConfig,
    source: str,
    *,
    init: str,
    pad_token_id: int | None,
    device: torch.device | str | None,
) -> Any:
    """The VLM of `source` with a value head `score`: loaded from the folder when it has one, else new ("zeros":
    a critic starting at V = 0; "normal": std 1/sqrt(H+1)). Vision tower frozen per `cfg.freeze_vision_tower`,
    the image hook installed; LoRA per `cfg.lora` (peft task SEQ_CLS, which trains `score`)."""
    from transformers import AutoModelForImageTextToText

    model = load_pretrained(
        AutoModelForImageTextToText, cfg.name_or_path, device=device, **model_kwargs(cfg, device)
    )
    config = model.config
    hidden = int(getattr(getattr(config, "text_config", None), "hidden_size", 0) or config.hidden_size)
    lm_head = model.get_output_embeddings()
    head = torch.nn.Linear(hidden, 1, bias=False, dtype=lm_head.weight.dtype, device=lm_head.weight.device)
    saved = saved_head(source)
    with torch.no_grad():
        if saved is not None:
            head.weight.copy_(saved.reshape(1, hidden))
        elif init == "zeros":
            head.weight.zero_()
        else:
            head.weight.normal_(0.0, 1.0 / math.sqrt(hidden + 1))
    model.score = head
    if lm_head.weight is not model.get_input_embeddings().weight:
        lm_head.weight.requires_grad_(False)  # unused by the critic (tied: it is the trunk's embedding)
    if pad_token_id is not None:
        config.pad_token_id = pad_token_id
    prepare_vlm(model, train_vision=not cfg.freeze_vision_tower)
    return finish_model(model, cfg, task_type="SEQ_CLS")
