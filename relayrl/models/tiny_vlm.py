"""A tiny Qwen2-VL built locally in seconds (no download): the tests' and the CPU demo's vision-language model.

    path = save_tiny_vlm(tmp / "vlm")     model + tokenizer + image processor, loadable by from_pretrained

A Qwen2-VL (`Qwen2VLForConditionalGeneration`) with a one-block vision tower (patch 4, merge 2: a 24 x 24 image
is 6 x 6 = 36 patches, 9 tokens) and a 2-layer text decoder, random weights; the tiny character tokenizer of
relayrl.models.tiny plus Qwen2-VL's vision special tokens; a Qwen2-VL image processor (PIL backend, so no
torchvision) saved as preprocessor_config.json. From a shell: `python -m relayrl.models.tiny_vlm OUT`.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, cast

import torch

from relayrl.models.tiny import IM_START, build_tiny_tokenizer

VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
IMAGE_SIDE = 24
"""Side in pixels of the images the tiny processor keeps whole (min_pixels 16**2 <= 24**2 <= max_pixels 32**2)."""


def build_tiny_vlm_tokenizer() -> Any:
    """The tiny character tokenizer (relayrl.models.tiny) plus Qwen2-VL's vision special tokens."""
    tok = build_tiny_tokenizer()
    extra = [IM_START, *VISION_TOKENS]
    tok.add_special_tokens({"additional_special_tokens": extra})  # pyright: ignore[reportArgumentType]
    return tok


def save_tiny_vlm(path: str | Path, *, hidden: int = 64, layers: int = 2, seed: int = 0) -> Path:
    """A tiny random Qwen2-VL (one vision block, patch 4, merge 2) with its tokenizer and image processor saved
    to `path` (loadable by from_pretrained / AutoImageProcessor); returns the path."""
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    path = Path(path)
    tok = build_tiny_vlm_tokenizer()
    ids = {t: int(cast(int, tok.convert_tokens_to_ids(t))) for t in VISION_TOKENS}
    heads = 4
    half = hidden // heads // 2  # rotary frequencies per head, split over (t, h, w)
    section = [half - 2 * (half // 3), half // 3, half // 3]
    config = Qwen2VLConfig(
        text_config=dict(
            vocab_size=len(tok),
            hidden_size=hidden,
            intermediate_size=2 * hidden,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=2,
            max_position_embeddings=512,
            rope_scaling={"type": "mrope", "mrope_section": section},
            tie_word_embeddings=True,
            pad_token_id=tok.pad_token_id,
            eos_token_id=tok.eos_token_id,
            bos_token_id=None,
        ),
        vision_config=dict(
            depth=1,
            embed_dim=32,
            hidden_size=hidden,
            num_heads=2,
            patch_size=4,
            spatial_merge_size=2,
            temporal_patch_size=2,
            mlp_ratio=2,
            in_channels=3,
        ),
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=True,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
        bos_token_id=None,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2VLForConditionalGeneration(config)
    model.generation_config.pad_token_id = tok.pad_token_id
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.bos_token_id = None
    model.save_pretrained(path)
    tok.save_pretrained(path)
    Qwen2VLImageProcessorPil(
        patch_size=4, merge_size=2, temporal_patch_size=2, min_pixels=16 * 16, max_pixels=32 * 32
    ).save_pretrained(path)
    return path


if __name__ == "__main__":
    print(
        f"tiny vision-language model written to {save_tiny_vlm(sys.argv[1] if len(sys.argv) > 1 else 'runs/tiny-vlm')}"
    )
