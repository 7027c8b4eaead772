"""A tiny Qwen2-VL built locally in seconds (no download): the tests' and the CPU demo's vision-language model.

    path = save_tiny_vlm(tmp / "vlm")     model + tokenizer + image processor, loadable by from_pretrained

A Qwen2-VL (`Qwen2VLForConditionalGeneration`) with a one-block vision tower (patch 4, merge 2: a 24 x 24 image
is 6 x 6 = 36 patches, 9 tokens) and a 2-layer text decoder, random weights; the tiny character tokenizer of
relayrl.models.tiny plus Qwen2-VL's vision special tokens; a Qwen2-VL image processor (PIL backend, so no
torchvision) saved as preprocessor_config.json. From a shell: `python -m relayrl.models.tiny_vlm OUT`.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch

from relayrl.models.tiny import IM_START, build_tiny_tokenizer

VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
IMAGE_SIDE = 24
"""Side in pixels of the images the tiny processor keeps whole (min_pixels 16**2 <= 24**2 <= max_pixels 32**2)."""


def image_processor_class() -> Any:
    """Qwen2-VL's image processor class: the PIL backend where transformers has one (no torchvision needed),
    else the default class. Either saves `"image_processor_type": "Qwen2VLImageProcessor"`, which every
    transformers 5 release loads."""
    try:
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        return Qwen2VLImageProcessorPil
    except ImportError:  # transformers releases before the PIL backends
        from transformers import Qwen2VLImageProcessor

        return Qwen2VLImageProcessor


def build_tiny_vlm_tokenizer() -> Any:
    """The tiny character tokenizer (relayrl.models.tiny) plus Qwen2-VL's vision special tokens."""
    tok = build_tiny_tokenizer()
    extra = [IM_START, *VISION_TOKENS]
    tok.add_special_tokens({"additional_special_tokens": extra})  # pyright: ignore[reportArgumentType]
    return tok


@dataclass(kw_only=True, slots=True)
class VLMShape:
    """Shape of a locally built Qwen2-VL (random weights). The defaults are the tiny test model."""

    hidden: int = 64
    """Text hidden size (also the vision merger's output size)."""
    layers: int = 2
    """Text decoder layers."""
    heads: int = 4
    """Text attention heads."""
    kv_heads: int = 2
    """Text key/value heads."""
    intermediate: int = 128
    """Text MLP width."""
    vocab: int = 0
    """Vocabulary rows of the embeddings / head; 0 = the tokenizer's size (ids past it are never produced by
    the tokenizer, and decode to nothing)."""
    vision_depth: int = 1
    """Vision transformer blocks."""
    vision_dim: int = 32
    """Vision embedding width."""
    vision_heads: int = 2
    """Vision attention heads."""
    patch: int = 4
    """Patch side in pixels (Qwen2-VL: 14)."""
    min_pixels: int = 16 * 16
    """The image processor's lower bound on an image's area (it resizes up to reach it)."""
    max_pixels: int = 32 * 32
    """The image processor's upper bound on an image's area."""
    seed: int = 0
    """Seed of the random weights."""


QWEN2_VL_2B = VLMShape(
    hidden=1536, layers=28, heads=12, kv_heads=2, intermediate=8960, vocab=151936, vision_depth=32,
    vision_dim=1280, vision_heads=16, patch=14, min_pixels=56 * 56, max_pixels=448 * 448,
)  # fmt: skip
"""Qwen2-VL-2B-Instruct's shape (about 2.2B parameters), for benchmarks (bench/vlm.py)."""


def save_tiny_vlm(
    path: str | Path, shape: VLMShape | None = None, *, dtype: torch.dtype | None = None, device: str = "cpu"
) -> Path:
    """A random Qwen2-VL of `shape` (default: the tiny test model: one vision block, patch 4, merge 2) with
        the tiny tokenizer and a Qwen2-VL image processor saved to `path` (loadable by from_pretrained /
        AutoImageProcessor); `dtype` the saved weights' dtype (default fp32); `device` where the random weights are
    drawn (a GPU builds the 2B shape in seconds). Returns the path."""
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    shape = shape or VLMShape()
    path = Path(path)
    tok = build_tiny_vlm_tokenizer()
    ids = {t: int(cast(int, tok.convert_tokens_to_ids(t))) for t in VISION_TOKENS}
    half = shape.hidden // shape.heads // 2  # rotary frequencies per head, split over (t, h, w)
    section = [half - 2 * (half // 3), half // 3, half // 3]
    special = dict(pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=None)
    config = Qwen2VLConfig(
        text_config=dict(
            vocab_size=shape.vocab or len(tok),
            hidden_size=shape.hidden,
            intermediate_size=shape.intermediate,
            num_hidden_layers=shape.layers,
            num_attention_heads=shape.heads,
            num_key_value_heads=shape.kv_heads,
            max_position_embeddings=4096,
            rope_scaling={"type": "mrope", "mrope_section": section},
            tie_word_embeddings=True,
            **special,
        ),
        vision_config=dict(
            depth=shape.vision_depth,
            embed_dim=shape.vision_dim,
            hidden_size=shape.hidden,
            num_heads=shape.vision_heads,
            patch_size=shape.patch,
            spatial_merge_size=2,
            temporal_patch_size=2,
            mlp_ratio=4 if shape.vision_depth > 1 else 2,
            in_channels=3,
        ),
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=True,
        **special,
    )
    with torch.random.fork_rng(devices=[device] if device != "cpu" else []), torch.device(device):
        torch.manual_seed(shape.seed)
        model = Qwen2VLForConditionalGeneration(config)
    if dtype is not None:
        model = cast(Any, model).to(dtype)
    for key, value in special.items():
        setattr(model.generation_config, key, value)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    image_processor_class()(
        patch_size=shape.patch, merge_size=2, temporal_patch_size=2, min_pixels=shape.min_pixels,
        max_pixels=shape.max_pixels,
    ).save_pretrained(path)  # fmt: skip
    return path


if __name__ == "__main__":
    print(
        f"tiny vision-language model written to {save_tiny_vlm(sys.argv[1] if len(sys.argv) > 1 else 'runs/tiny-vlm')}"
    )
