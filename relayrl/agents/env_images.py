"""Images an agent environment returns (`environment_images` in a step result, OpenRLHF's key): they join the
trajectory's next turn (vision-language models, docs/vlm.md).

    ids = feedback_ids(tokenizer, feedback_text, step_output.get("environment_images"), traj, where)

The feedback text marks each image with `<image>` (images without markers go before the text); each image is
opened (a PIL image, a local path or a data URI, relayrl.data.images.open_image), processed by the model's image
processor, and its pad tokens expanded, exactly as a prompt's; `traj.images` grows by them, so the next
engine request and the trainer's forward see the prompt's images followed by every turn's.
"""

from __future__ import annotations

from typing import Any

from relayrl.agents.base import Trajectory
from relayrl.data.images import IMAGE_MARKER, load_vision, open_image


class EnvironmentImageError(ValueError):
    """The environment's images cannot be used (a text model, a bad image, markers that do not match)."""


def feedback_ids(tokenizer: Any, feedback: str, images: Any, traj: Trajectory, where: str) -> list[int]:
    """Token ids of the feedback text with its images (expanded pad tokens); `traj.images` gets the images.
    Without images: the plain tokenization of `feedback`."""
    if not images:
        return list(tokenizer(feedback, add_special_tokens=False)["input_ids"]) if feedback else []
    if not isinstance(images, list | tuple):
        images = [images]
    vision = load_vision(tokenizer)
    if vision is None:
        raise EnvironmentImageError(f"{where} returned environment_images but the model is text-only")
    opened = [open_image(im, f"{where} environment_images[{i}]") for i, im in enumerate(images)]
    markers = feedback.count(IMAGE_MARKER)
    if markers == 0:
        feedback = IMAGE_MARKER * len(opened) + feedback
    elif markers != len(opened):
        raise EnvironmentImageError(
            f"{where}: environment_feedback has {markers} {IMAGE_MARKER!r} marker(s) but {len(opened)} image(s)"
        )
    new = vision.process([im for im, _ in opened], [src for _, src in opened])
    ids = vision.encode(tokenizer, feedback, new, where)
    traj.images = new if traj.images is None else traj.images.concat(new)
    return ids
