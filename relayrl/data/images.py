"""Images in the data of vision-language models (docs/vlm.md): an image column, `<image>` markers, the
model's own image processor, and image-pad tokens expanded at the token level so loss masks stay exact.

    vision = load_vision(tokenizer)                       None for a text-only model (no image processor)
    row, images = prepare_row(row, vision, "images")      markers -> the model's placeholder; images processed
    ids, mask = vision.expand(ids, mask, images, where)   one image-pad token -> one per merged patch

A row names its images in `data.image_key` (default "images"): one value or a list, each a local file path
(absolute, or relative to the data file's folder, else to the working directory), a `data:image/...;base64,`
URI (the built-in image task writes these), or an http(s) URL (fetched only when online: offline it is a
clear error naming the row). Text holds one `<image>` marker per image, in the order of the column, in the
prompt or in a chat message; a row with images and no marker gets them at the start of its first user text.
Each marker becomes the model's placeholder text (Qwen2-VL: `<|vision_start|><|image_pad|><|vision_end|>`),
the row is tokenized as any other, and then each image-pad token is repeated as many times as the processor's
patch grid says (t * h * w / merge_size**2, what Qwen2VLProcessor inserts). The pixels come from the model's
image processor (`AutoImageProcessor`, the preprocessor_config.json next to the model), once, here.
"""

from __future__ import annotations

import base64
import functools
import io
import urllib.request
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from relayrl.data.loading import DataError, MalformedRowError, hub_offline_reason
from relayrl.data.records import RawRow
from relayrl.rollout.media import ImageInputs

IMAGE_MARKER = "<image>"
"""What a data row writes where an image goes."""
URL_TIMEOUT_S = 10.0


@dataclass(kw_only=True, slots=True)
class Vision:
    """A model's image processor and its image tokens."""

    processor: Any
    """The model's image processor (transformers ImageProcessor): images -> pixel_values, image_grid_thw."""
    image_token_id: int
    """The image-pad token repeated once per merged patch."""
    placeholder: str
    """Text that stands for one image before expansion (vision start + one image pad + vision end)."""
    merge_size: int
    """Patches merged into one token per side."""

    def process(self, images: list[Any], sources: list[str]) -> ImageInputs:
        """Decoded images -> ImageInputs through the model's image processor."""
        out = self.processor(images=images, return_tensors="pt")
        return ImageInputs(
            pixel_values=out["pixel_values"].float(),
            image_grid_thw=out["image_grid_thw"].long(),
            merge_size=self.merge_size,
            images=list(images),
            sources=list(sources),
        )

    def expand(
        self, ids: list[int], mask: list[bool] | None, images: ImageInputs | None, where: str
    ) -> tuple[list[int], list[bool] | None]:
        """Repeat the k-th image-pad token num_tokens[k] times (mask copied: False on a prompt image); an error
        naming `where` when the placeholders and the images do not match one to one."""
        counts = images.num_tokens() if images is not None else []
        found = ids.count(self.image_token_id)
        if found != len(counts):
            raise DataError(
                f"{where}: {found} image placeholder(s) in the tokens but {len(counts)} image(s); write one "
                f"{IMAGE_MARKER!r} per image (and no literal image-pad token in the text)"
            )
        out_ids: list[int] = []
        out_mask: list[bool] = []
        k = 0
        for i, tok in enumerate(ids):
            reps = 1
            if tok == self.image_token_id:
                reps, k = counts[k], k + 1
            out_ids += [tok] * reps
            if mask is not None:
                out_mask += [mask[i]] * reps
        return out_ids, (out_mask if mask is not None else None)

    def encode(self, tokenizer: Any, text: str, images: ImageInputs | None, where: str) -> list[int]:
        """Text with `<image>` markers -> expanded token ids (environment feedback, prompts built in code)."""
        text = text.replace(IMAGE_MARKER, self.placeholder)
        ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
        return self.expand(ids, None, images, where)[0]


def _model_folder(tokenizer: Any) -> Path | None:
    name = getattr(tokenizer, "name_or_path", "") or ""
    path = Path(name)
    return path if name and (path / "preprocessor_config.json").is_file() else None


@functools.cache
def _load_processor(folder: str) -> Any:
    from transformers import AutoImageProcessor

    return AutoImageProcessor.from_pretrained(folder)


def load_vision(tokenizer: Any) -> Vision | None:
    """The Vision of the model whose folder `tokenizer` was loaded from; None when that folder has no image
    processor (a text-only model). Needs the tokenizer to know the image-pad token."""
    folder = _model_folder(tokenizer)
    if folder is None:
        return None
    processor = _load_processor(str(folder))
    token = getattr(tokenizer, "image_token", None) or "<|image_pad|>"
    image_id = tokenizer.convert_tokens_to_ids(token)
    if image_id is None or image_id == tokenizer.unk_token_id:
        raise DataError(f"{folder}: has an image processor but its tokenizer has no {token!r} token")
    start, end = "<|vision_start|>", "<|vision_end|>"
    has_frame = tokenizer.convert_tokens_to_ids(start) not in (None, tokenizer.unk_token_id)
    return Vision(
        processor=processor,
        image_token_id=int(image_id),
        placeholder=f"{start}{token}{end}" if has_frame else token,
        merge_size=int(getattr(processor, "merge_size", 1) or 1),
    )


# ---------------------------------------------------------------------------------------- reading images
def open_image(value: Any, where: str, base: Path | None = None) -> tuple[Any, str]:
    """(RGB PIL image, source) of one image cell: a path, a data URI, an http(s) URL, or a PIL image."""
    from PIL import Image

    if isinstance(value, Image.Image):
        return value.convert("RGB"), "inline"
    if isinstance(value, dict) and isinstance(value.get("path") or value.get("url"), str):
        value = value.get("path") or value.get("url")
    if not isinstance(value, str) or not value.strip():
        raise DataError(f"{where}: an image must be a file path, a data URI or a URL, got {value!r:.60}")
    if value.startswith("data:image/"):
        try:
            raw = base64.b64decode(value.split(",", 1)[1])
            return Image.open(io.BytesIO(raw)).convert("RGB"), "inline"
        except (IndexError, ValueError, OSError) as e:
            raise DataError(f"{where}: cannot decode the data-URI image ({e})") from e
    if value.startswith(("http://", "https://")):
        return _fetch(value, where), value
    path = Path(value)
    if not path.is_absolute() and base is not None and (base / path).exists():
        path = base / path
    if not path.is_file():
        raise DataError(
            f"{where}: image file {value!r} not found (looked in {base or '.'} and the working directory); "
            "fix the path in the row, or give an absolute path"
        )
    try:
        return Image.open(path).convert("RGB"), str(path)
    except OSError as e:
        raise DataError(f"{where}: cannot read image file {str(path)!r} ({e})") from e


def _fetch(url: str, where: str) -> Any:
    from PIL import Image

    reason = hub_offline_reason()
    if reason is not None:
        raise DataError(
            f"{where}: image URL {url!r} cannot be fetched offline ({reason}); download the image and give "
            "its local path instead"
        )
    try:
        with urllib.request.urlopen(url, timeout=URL_TIMEOUT_S) as resp:
            return Image.open(io.BytesIO(resp.read())).convert("RGB")
    except OSError as e:
        raise DataError(f"{where}: cannot fetch image URL {url!r} ({e})") from e


# ---------------------------------------------------------------------------------------- rows
def _texts_with_markers(row: RawRow) -> int:
    n = 0
    for value in row.data.values():
        if isinstance(value, str):
            n += value.count(IMAGE_MARKER)
        elif isinstance(value, list):
            n += sum(m.get("content", "").count(IMAGE_MARKER) for m in value if isinstance(m, dict))
    return n


def _replace(value: Any, placeholder: str) -> Any:
    if isinstance(value, str):
        return value.replace(IMAGE_MARKER, placeholder)
    if isinstance(value, list):
        return [
            {**m, "content": m["content"].replace(IMAGE_MARKER, placeholder)}
            if isinstance(m, dict) and isinstance(m.get("content"), str)
            else m
            for m in value
        ]
    return value


def _prepend_markers(row: RawRow, n: int, input_key: str, messages_key: str) -> dict[str, Any]:
    """Images without markers: `n` markers at the start of the first user text."""
    data, marks = dict(row.data), IMAGE_MARKER * n
    for key in (messages_key, input_key):
        value = data.get(key)
        if isinstance(value, list):
            for i, m in enumerate(value):
                if isinstance(m, dict) and m.get("role") == "user" and isinstance(m.get("content"), str):
                    data[key] = [*value[:i], {**m, "content": marks + m["content"]}, *value[i + 1 :]]
                    return data
        elif isinstance(value, str):
            data[key] = marks + value
            return data
    raise MalformedRowError(row, input_key, f"has {n} image(s) but no user text to put them in")


def prepare_row(
    row: RawRow,
    vision: Vision | None,
    image_key: str,
    *,
    input_key: str = "input",
    messages_key: str = "messages",
) -> tuple[RawRow, ImageInputs | None]:
    """(the row with each `<image>` replaced by the model's placeholder, its processed images or None).
    Errors name the file and row: a missing image file, a marker count that differs from the image count,
    images given to a text-only model."""
    cell = row.data.get(image_key)
    values = [] if cell is None else (cell if isinstance(cell, list) else [cell])
    markers = _texts_with_markers(row)
    if vision is None:
        if values or markers:
            raise MalformedRowError(
                row,
                image_key if values else None,
                "has images but the model has no image processor (a text-only model); use a vision-language "
                "model folder (with preprocessor_config.json) or drop the images",
            )
        return row, None
    if not values:
        return (row, None) if not markers else _marker_error(row, markers, 0)
    base = Path(row.file).parent if row.file else None
    opened = [open_image(v, f"{row.where}: {image_key}[{i}]", base) for i, v in enumerate(values)]
    data = row.data
    if markers == 0:
        data = _prepend_markers(row, len(values), input_key, messages_key)
    elif markers != len(values):
        _marker_error(row, markers, len(values))
    data = {k: _replace(v, vision.placeholder) for k, v in data.items()}
    images = vision.process([im for im, _ in opened], [src for _, src in opened])
    return replace(row, data=data), images


def _marker_error(row: RawRow, markers: int, images: int) -> Any:
    raise MalformedRowError(
        row,
        None,
        f"has {markers} {IMAGE_MARKER!r} marker(s) but {images} image(s); write one marker per image",
    )
