"""Vision-language models (Qwen2-VL / Qwen2.5-VL shaped; docs/vlm.md): detection, the frozen vision tower,
and images reaching relayrl's one forward.

    is_vlm(model) / is_vlm_folder(path)        a `vision_config` in the model's config (the folder's: rollout.media)
    prepare_vlm(model, train_vision=False)     freeze the vision tower (default); install the image hook
    with images_for([imgs_0, None, imgs_2]):    the forward of these three sequences (models.forward) sees
        token_logprobs(model, seqs, "padded")   their images: the hook adds pixel_values / image_grid_thw

How images reach the forward without a second forward path: relayrl.models.forward calls the decoder trunk
(`hf.model`, a Qwen2VLModel) with token ids only. `prepare_vlm` registers a forward pre-hook on that trunk
that, inside `images_for(...)`, adds the images of the sequences being run (their pixel_values concatenated
in sequence order, their patch grids, and the token-type ids that mark image tokens), so the trunk embeds the
images at their pad tokens and computes its own 3-D rope positions. Outside the block (HF generate, which
passes the images itself) the hook does nothing. The rope positions of image tokens are not the token
index, so a VLM runs the padded layout (models.forward._architecture_blocker): the varlen layout's packed
1-D positions would be wrong.

The tiny Qwen2-VL of the tests (no download) is relayrl.models.tiny_vlm.
"""

from __future__ import annotations

import contextlib
import contextvars
import shutil
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from relayrl.rollout.media import ImageInputs, image_forward_inputs, is_vlm_folder

VISION_PREFIXES = ("visual.", "model.visual.", "vision_tower.", "model.vision_tower.", "vision_model.")
"""Parameter-name prefixes of a vision tower (Qwen2-VL `visual`, LLaVA-style `vision_tower`), after peft's
prefixes are stripped."""

PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json")
"""A VLM folder's image-processor files, copied beside the tokenizer wherever it is saved."""

__all__ = [
    "images_for",
    "install_image_hook",
    "is_vlm",
    "is_vlm_folder",
    "keep_image_processor",
    "prepare_vlm",
    "vision_parameter_names",
]

_IMAGES: contextvars.ContextVar[ImageInputs | None] = contextvars.ContextVar("relayrl_images", default=None)


def _hf(model: Any) -> Any:
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def is_vlm(model: Any) -> bool:
    """True for a vision-language model (its config has a vision_config)."""
    return getattr(getattr(_hf(model), "config", None), "vision_config", None) is not None


def vision_parameter_names(model: Any) -> list[str]:
    """Names (as `model.named_parameters()` gives them) of the vision tower's parameters."""
    out = []
    for name, _ in model.named_parameters():
        bare = name.removeprefix("base_model.model.")
        if bare.startswith(VISION_PREFIXES) or ".visual." in f".{bare}":
            out.append(name)
    return out


def prepare_vlm(model: Any, *, train_vision: bool = False) -> Any:
    """Freeze the vision tower unless `train_vision` (its parameters stop requiring grad: the optimizer skips
    them and the engine sync, which refreshes trained parameters only, never sends them) and install the
    image hook on the trunk. Returns `model`. A text model is returned unchanged."""
    if not is_vlm(model):
        return model
    if not train_vision:
        names = set(vision_parameter_names(model))
        for name, p in model.named_parameters():
            if name in names:
                p.requires_grad_(False)
    install_image_hook(model)
    return model


def install_image_hook(model: Any) -> None:
    """Register (once) the forward pre-hook that adds `images_for`'s images to the trunk's inputs."""
    hf = _hf(model)
    trunk = getattr(hf, hf.base_model_prefix)
    if getattr(trunk, "_relayrl_image_hook", False):
        return
    token_id = int(hf.config.image_token_id)

    def hook(module: Any, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]] | None:
        images, ids = _IMAGES.get(), kwargs.get("input_ids")
        if kwargs.get("pixel_values") is not None:
            return None  # generate passes its images itself
        if images is None:  # a training forward (use_cache False) must not treat pads as text
            if ids is not None and kwargs.get("use_cache") is False and bool((ids == token_id).any()):
                raise ValueError(
                    "a VLM forward over image-pad tokens without their images: run it inside "
                    "relayrl.models.vlm.images_for(images of each sequence)"
                )
            return None
        if ids is None:
            raise ValueError(
                "a VLM forward with images needs input_ids (the image-pad tokens mark the images)"
            )
        if kwargs.get("position_ids") is not None:
            raise ValueError(
                "vision-language models run the padded layout (3-D rope positions); the varlen layout's packed "
                "positions cannot carry them"
            )
        kwargs.update(image_forward_inputs(hf, ids, images))
        return args, kwargs

    trunk.register_forward_pre_hook(hook, with_kwargs=True)
    trunk._relayrl_image_hook = True


@contextlib.contextmanager
def images_for(images: Sequence[ImageInputs | None] | None) -> Iterator[None]:
    """Inside the block, the forward of a VLM whose sequences are listed in this order sees their images
    (None entries: text-only sequences). Nothing happens when no entry has images."""
    token = _IMAGES.set(ImageInputs.join(images) if images else None)
    try:
        yield
    finally:
        _IMAGES.reset(token)


def keep_image_processor(tokenizer: Any, folder: str | Path) -> Any:
    """`tokenizer` (loaded from a VLM's `folder`) whose `save_pretrained` also copies the folder's image-processor
    files: every checkpoint and exported model folder (they all save the tokenizer beside the weights) stays
    a complete VLM folder that relayrl.data.images and vLLM can load. A folder without them: unchanged."""
    files = [Path(folder) / f for f in PROCESSOR_FILES if (Path(folder) / f).is_file()]
    if not files:
        return tokenizer
    original = tokenizer.save_pretrained

    def save_pretrained(save_directory: str | Path, *args: Any, **kwargs: Any) -> Any:
        out = original(save_directory, *args, **kwargs)
        for f in files:
            target = Path(save_directory) / f.name
            if target.resolve() != f.resolve():
                shutil.copyfile(f, target)
        return out

    tokenizer.save_pretrained = save_pretrained
    return tokenizer
