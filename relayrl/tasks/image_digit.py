"""`image_digit`: read the digit drawn into a small image (the built-in vision-language task, docs/vlm.md).

Each row's image is a 24 x 24 RGB picture of one digit 0-9 in a 3 x 5 pixel font scaled 3 times (9 x 15
pixels), drawn near the centre (its corner moved up to JITTER = 2 pixels each way) on a dark background in one of four ink colours, with light noise; the
prompt is `<image>digit?`, the answer the digit. Images are generated procedurally (numpy -> PNG by PIL) and
travel inside the row as `data:image/png;base64,...` URIs, so the rows are plain JSONL like every task's.
Reward 1.0 for an exact match of the stripped response, else 0.0. Train and test pictures are disjoint: each
(digit, dx, dy, colour) is assigned to a split by a hash (`is_held_out`), so a test picture never appears in
training (the digits themselves are shared: the task is reading, not memorising).
"""

from __future__ import annotations

import base64
import io
import random
from dataclasses import dataclass
from typing import Any

import numpy as np

from relayrl.tasks.base import is_held_out

SIDE = 24
SCALE = 3
FONT = {  # 3 x 5 bitmaps, one string of 5 rows of 3 pixels per digit
    "0": "111101101101111",
    "1": "010110010010111",
    "2": "111001111100111",
    "3": "111001111001111",
    "4": "101101111001001",
    "5": "111100111001111",
    "6": "111100111101111",
    "7": "111001010010010",
    "8": "111101111101111",
    "9": "111101111001111",
}
COLOURS = [(255, 255, 255), (255, 220, 80), (120, 220, 255), (255, 140, 140)]
JITTER = 2
"""The digit's top-left corner moves by up to this many pixels from the centred spot, each way."""
PROMPT = "<image>digit?"
X0, Y0 = (SIDE - 3 * SCALE) // 2, (SIDE - 5 * SCALE) // 2  # the centred corner


def draw_digit(digit: str, dx: int, dy: int, colour: int, seed: int = 0) -> np.ndarray:
    """[SIDE, SIDE, 3] uint8 picture of `digit` with its top-left corner at (dx, dy)."""
    rng = np.random.default_rng(seed)
    img = rng.integers(0, 40, size=(SIDE, SIDE, 3), dtype=np.int64)  # dark noisy background
    bits = np.array([int(b) for b in FONT[digit]], dtype=bool).reshape(5, 3)
    mask = np.kron(bits, np.ones((SCALE, SCALE), dtype=bool))  # [15, 9]
    h, w = mask.shape
    img[dy : dy + h, dx : dx + w][mask] = COLOURS[colour]
    return img.clip(0, 255).astype(np.uint8)


def png_data_uri(img: np.ndarray) -> str:
    """A `data:image/png;base64,...` URI of an [H, W, 3] uint8 picture."""
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(img).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


@dataclass
class ImageDigit:
    """Which digit is drawn in the picture."""

    name: str = "image_digit"
    digits: str = "0123456789"
    """The digits drawn (the CPU learning tests use "01")."""

    def _items(self, split: str) -> list[tuple[str, int, int, int]]:
        items = [
            (d, dx, dy, c)
            for d in self.digits
            for dx in range(X0 - JITTER, X0 + JITTER + 1)
            for dy in range(Y0 - JITTER, Y0 + JITTER + 1)
            for c in range(len(COLOURS))
        ]
        return [it for it in items if is_held_out(f"{self.name}:{it}") == (split == "test")]

    def make_rows(self, split: str, n: int, seed: int) -> list[dict[str, Any]]:
        if split not in ("train", "test"):
            raise ValueError(f"split must be 'train' or 'test', got {split!r}")
        items = self._items(split)
        if n > len(items):
            raise ValueError(f"{self.name}: asked for {n} {split} rows but only {len(items)} exist")
        rng = random.Random(seed)
        rows = []
        for k, (d, dx, dy, c) in enumerate(rng.sample(items, n)):
            image = png_data_uri(draw_digit(d, dx, dy, c, seed=seed * 100_003 + k))
            rows.append({"input": PROMPT, "output": d, "label": d, "images": [image]})
        return rows

    def reward(self, response: str, label: Any) -> float:
        return 1.0 if response.strip() == str(label) else 0.0
