"""Images of one prompt or trajectory, processed once at the edge (vision-language models, docs/vlm.md).

    images = ImageInputs(pixel_values=[P, D], image_grid_thw=[I, 3], images=[PIL...], sources=["a.png", ...])
    both = images.concat(more)              a trajectory's prompt images + an environment turn's images
    batch = ImageInputs.join([a, None, b])  the images of several sequences, in sequence order (None: none)

The token ids that go with them already hold one image-pad token per merged patch (`num_tokens`), placed by
relayrl.data.images. Engines read `pixel_values` / `image_grid_thw` (hf) or `images` (vLLM's
multi_modal_data); the trainer's forward reads the tensors through relayrl.models.vlm.
"""

from __future__ import annotations

import functools
import inspect
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch


@dataclass(kw_only=True, slots=True)
class ImageInputs:
    """The images of one sequence, in the order their placeholders appear in its tokens."""

    pixel_values: torch.Tensor
    """[P, D] float32: the processor's flattened patches of every image, concatenated (Qwen2-VL layout)."""
    image_grid_thw: torch.Tensor
    """[I, 3] long: (temporal, height, width) patch grid of each of the I images."""
    merge_size: int = 1
    """Patches merged into one token per side (spatial_merge_size): tokens per image = t*h*w / merge_size**2."""
    images: list[Any] = field(default_factory=list)
    """[I] the decoded images (PIL.Image, RGB), for engines that process images themselves (vLLM)."""
    sources: list[str] = field(default_factory=list)
    """[I] where each image came from (a file path, a URL, "inline"), for error messages and reward functions."""

    @property
    def count(self) -> int:
        """Number of images I."""
        return int(self.image_grid_thw.shape[0])

    def num_tokens(self) -> list[int]:
        """Placeholder tokens of each image in the token ids (t * h * w / merge_size**2)."""
        return [int(n) // self.merge_size**2 for n in self.image_grid_thw.prod(-1).tolist()]

    def concat(self, other: ImageInputs | None) -> ImageInputs:
        """These images followed by `other`'s (a later turn's)."""
        return self if other is None else ImageInputs.join([self, other]) or self

    def collapse(self, ids: Sequence[int], token_id: int) -> list[int]:
        """`ids` with each image's run of pad tokens cut back to one (what an engine that expands images itself,
        vLLM, takes); the inverse of relayrl.data.images.Vision.expand."""
        counts, out, k, skip = self.num_tokens(), [], 0, 0
        for tok in ids:
            if skip:
                skip -= 1
                continue
            if tok == token_id and k < len(counts):
                skip, k = counts[k] - 1, k + 1
            out.append(tok)
        return out

    @staticmethod
    def join(items: Sequence[ImageInputs | None]) -> ImageInputs | None:
        """The images of several sequences in order (those without images skipped); None when there are none."""
        real = [x for x in items if x is not None and x.count]
        if not real:
            return None
        if len(real) == 1:
            return real[0]
        return ImageInputs(
            pixel_values=torch.cat([x.pixel_values for x in real]),
            image_grid_thw=torch.cat([x.image_grid_thw for x in real]),
            merge_size=real[0].merge_size,
            images=[im for x in real for im in x.images],
            sources=[s for x in real for s in x.sources],
        )


@functools.cache
def _forward_params(cls: type) -> frozenset[str]:
    return frozenset(inspect.signature(cls.forward).parameters)


def image_forward_inputs(model: Any, input_ids: torch.Tensor, images: ImageInputs | None) -> dict[str, Any]:
    """The image inputs of a VLM's `generate` / forward beside `input_ids` [B, T] whose rows hold `images`
    (in row order): pixel_values, image_grid_thw, and the token types that mark image tokens where the
    transformers version takes them (5.24 does, 5.17 does not). Empty for no images."""
    if images is None:
        return {}
    hf = model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model
    device = input_ids.device
    out: dict[str, Any] = {
        "pixel_values": images.pixel_values.to(device),
        "image_grid_thw": images.image_grid_thw.to(device),
    }
    if "mm_token_type_ids" in _forward_params(type(getattr(hf, hf.base_model_prefix))):
        out["mm_token_type_ids"] = (input_ids == int(hf.config.image_token_id)).int()
    return out


VISION_TOKEN_KEYS = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")


def vision_token_ids(model: Any) -> list[int]:
    """A VLM's image / video placeholder tokens (never to be generated: a sampled image-pad token would claim
    an image that does not exist); [] for a text model."""
    hf = model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model
    cfg = getattr(hf, "config", None)
    if getattr(cfg, "vision_config", None) is None:
        return []
    return sorted({int(v) for k in VISION_TOKEN_KEYS if (v := getattr(cfg, k, None)) is not None})


def is_vlm_folder(path: str | Path) -> bool:
    """True when the model folder's config.json has a vision_config (False for Hub ids and other folders)."""
    cfg = Path(path) / "config.json"
    return cfg.is_file() and "vision_config" in json.loads(cfg.read_text())
