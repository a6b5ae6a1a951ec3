"""Images of the dataset's rows (``data.image_column``): loaded and checked once when the data
is loaded, then placed in the prompt's chat messages and rendered with the model's processor.

A cell of the image column holds one image or a list of them (a prompt with several images),
each one of: a path to an image file (absolute, or relative to the working directory), a PIL
image, or a ``datasets.Image`` value (``{"bytes": ..., "path": ...}``, how a Hub dataset's
image column reads without decoding). None or an empty list: the row's prompt has no image.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

from grpo_core.contracts import PromptImages
from grpo_core.errors import RunError

VALID = ("a path to an image file, a PIL image, a datasets.Image value ({bytes, path}), "
         "or a list of them")


def _open(value: Any, where: str):
    """One cell entry as an RGB PIL image, or a RunError naming ``where`` and what is valid."""
    from PIL import Image, UnidentifiedImageError

    if isinstance(value, Image.Image):
        return value.convert("RGB")
    if isinstance(value, dict) and ("bytes" in value or "path" in value):
        if value.get("bytes") is not None:
            source: Any = io.BytesIO(value["bytes"])
        elif value.get("path"):
            source = value["path"]
        else:
            raise RunError(f"{where}: an image value with neither bytes nor a path; each image must be {VALID}")
    elif isinstance(value, (str, Path)):
        source = value
    else:
        raise RunError(f"{where}: got {type(value).__name__}; each image must be {VALID}")
    if not isinstance(source, io.BytesIO) and not Path(source).is_file():
        raise RunError(f"{where}: image file '{source}' does not exist (relative paths are read from "
                       f"{Path.cwd()})")
    try:
        with Image.open(source) as image:
            image.load()
            return image.convert("RGB")
    except (UnidentifiedImageError, OSError, ValueError) as exc:
        name = "its bytes" if isinstance(source, io.BytesIO) else f"'{source}'"
        raise RunError(f"{where}: cannot read {name} as an image ({type(exc).__name__}: {exc})") from exc


def load_row_images(rows: list[dict], column: str, split: str) -> list[list[Any]]:
    """Every row's images (a list per row, possibly empty), loaded and checked; the first bad
    one raises a RunError naming its row, the column and what is valid."""
    if rows and column not in rows[0]:
        raise RunError(f"data.image_column needs column '{column}', which the {split} data does not have; "
                       f"its columns are: {', '.join(rows[0])}")
    out = []
    for index, row in enumerate(rows):
        cell = row.get(column)
        values = [] if cell is None else list(cell) if isinstance(cell, (list, tuple)) else [cell]
        where = f"data.image_column '{column}', {split} row {index}"
        out.append([_open(value, where) for value in values])
    return out


def with_images(messages: list[dict], count: int) -> list[dict]:
    """``messages`` with ``count`` image parts put first in the first user message, unless
    the messages already hold image parts (their places are then the dataset's)."""
    if not count or any(isinstance(m.get("content"), list) and any(
            isinstance(part, dict) and part.get("type") == "image" for part in m["content"]) for m in messages):
        return messages
    out, placed = [], False
    for message in messages:
        if not placed and message.get("role") == "user":
            content = message.get("content", "")
            parts = content if isinstance(content, list) else [{"type": "text", "text": str(content)}]
            message = {**message, "content": [{"type": "image"}] * count + list(parts)}
            placed = True
        out.append(message)
    if not placed:
        raise RunError("data.image_column: the prompt has no user message to put its image in")
    return out


def as_parts(messages: list[dict]) -> list[dict]:
    """Every message's content as a list of typed parts (processors' chat templates expect it
    once any message has images)."""
    return [m if isinstance(m.get("content"), list) else {**m, "content": [{"type": "text", "text": str(
        m.get("content", ""))}]} for m in messages]


def render_images(processor: Any, messages: list[dict], images: list[Any], template_kwargs: dict
                  ) -> tuple[str, list[int], PromptImages | None]:
    """``(text, ids, images)`` of chat ``messages`` with ``images``: the processor's chat
    template places the image parts, the processor expands each into its image tokens."""
    messages = as_parts(with_images(messages, len(images)))
    text = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **template_kwargs)
    text_ids = processor.tokenizer(text, add_special_tokens=False)["input_ids"]
    if not images:
        return text, text_ids, None
    encoded = processor(text=[text], images=[images], return_tensors="pt", add_special_tokens=False)
    return text, encoded["input_ids"][0].tolist(), PromptImages.from_processor(images, encoded, text_ids)
