"""Built-in dataset ``shapes``: a visual counting task whose images the dataset draws itself
(seeded, offline), for trying vision-language training on a laptop.

Each row is a small image (``size`` pixels a side) with between ``min_count`` and
``max_count`` filled shapes (squares, discs and triangles in random colours, never
overlapping) on a light ground; the prompt asks how many shapes there are, and the
``answer`` column holds the number (the ``accuracy`` reward reads it). The image column is
``image`` (a PIL image), which ``data.image_column: image`` hands to the model's processor.
"""

from __future__ import annotations

import random
from typing import Any

from pydantic import Field, model_validator

from grpo_core import hookimpl
from grpo_core.errors import RunError
from grpo_core.options import Options

__all__ = ["ShapesOptions", "ShapesDataset", "register_datasets"]

KINDS = ("square", "disc", "triangle")


class ShapesOptions(Options):
    """Options of the ``shapes`` task."""

    seed: int = Field(0, description="Seed of the drawings; same seed, same rows.")
    size: int = Field(56, ge=16, le=1024, description="Image width and height in pixels.")
    min_count: int = Field(1, ge=0, description="Fewest shapes in an image.")
    max_count: int = Field(4, ge=0, le=12, description="Most shapes in an image (at most 12).")
    train_size: int = Field(256, ge=1, description="Training rows.")
    eval_size: int = Field(32, ge=0, description="Held-out rows (drawn with other seeds); 0: no eval split.")
    instruction: str = Field("How many shapes are in the image? Answer with just the number.",
                             description="The question asked under each image.")

    @model_validator(mode="after")
    def _counts(self):
        if self.min_count > self.max_count:
            raise ValueError(f"min_count ({self.min_count}) must be <= max_count ({self.max_count})")
        return self


def _boxes(rng: random.Random, size: int, count: int) -> list[tuple[int, int, int]]:
    """``count`` non-overlapping squares ``(x, y, side)`` inside a ``size`` image."""
    side = max(4, size // 6)
    boxes: list[tuple[int, int, int]] = []
    for _ in range(2000):
        if len(boxes) == count:
            return boxes
        x, y = rng.randint(1, size - side - 1), rng.randint(1, size - side - 1)
        if all(abs(x - a) > side + 1 or abs(y - b) > side + 1 for a, b, _ in boxes):
            boxes.append((x, y, side))
    raise RunError(f"dataset 'shapes': {count} shapes do not fit in a {size}-pixel image; raise size "
                   "or lower max_count")


def draw(rng: random.Random, size: int, count: int):
    """A ``size`` x ``size`` RGB image with ``count`` shapes."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (size, size), (235, 235, 235))
    pen = ImageDraw.Draw(image)
    for x, y, side in _boxes(rng, size, count):
        colour = tuple(rng.randint(0, 180) for _ in range(3))
        kind = rng.choice(KINDS)
        if kind == "square":
            pen.rectangle([x, y, x + side, y + side], fill=colour)
        elif kind == "disc":
            pen.ellipse([x, y, x + side, y + side], fill=colour)
        else:
            pen.polygon([(x, y + side), (x + side, y + side), (x + side // 2, y)], fill=colour)
    return image


class ShapesDataset:
    """Images of a few shapes to count, drawn from a seeded generator (one per split)."""

    def __init__(self, options: ShapesOptions | None = None):
        self.options = options or ShapesOptions()

    def load(self, split: str) -> list[dict[str, Any]]:
        if split not in ("train", "eval"):
            raise RunError(f"dataset 'shapes': unknown split {split!r}; valid: train, eval")
        o = self.options
        n = o.train_size if split == "train" else o.eval_size
        rng = random.Random(f"shapes-{o.seed}-{split}")
        rows = []
        for _ in range(n):
            count = rng.randint(o.min_count, o.max_count)
            rows.append({"prompt": [{"role": "user", "content": o.instruction}], "image": draw(rng, o.size, count),
                         "answer": str(count)})
        return rows


@hookimpl
def register_datasets(register) -> None:
    register.add("shapes", ShapesDataset, options=ShapesOptions,
                 description="count the shapes in small images the dataset draws (data.image_column: image)")
