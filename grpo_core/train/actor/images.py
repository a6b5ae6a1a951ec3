"""Images of the dataset's rows (``data.image_column``): loaded and checked once when the data
is loaded, then placed in the prompt's chat messages and rendered with the model's processor.

A cell of the image column holds one image or a list of them (a prompt with several images),
each one of: a path to an image file (absolute, or relative to the working directory), a PIL
image, or a ``datasets.Image`` value (``{"bytes": ..., "path": ...}``, how a Hub dataset's
image column reads without decoding). None or an empty list: the row's prompt has no image.
"""

from __future__ import annotations

import io
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from grpo_core.contracts import PromptImages
from grpo_core.errors import RunError

VALID = ("a path to an image file, a PIL image, a datasets.Image value ({bytes, path}), "
         "or a list of them")


#: Pillow's decompression-bomb guard is a module global (``Image.MAX_IMAGE_PIXELS``): it is
#: lifted for one image at a time, under this lock, while the spec's limit is checked instead.
_GUARD = threading.Lock()


@contextmanager
def _own_guard():
    """Pillow's guard lifted (restored after); yields Pillow's limit as it was, which
    refuses images of more than twice its pixels (None: none)."""
    from PIL import Image

    with _GUARD:
        pillows, Image.MAX_IMAGE_PIXELS = Image.MAX_IMAGE_PIXELS, None
        try:
            yield pillows
        finally:
            Image.MAX_IMAGE_PIXELS = pillows


def _check_pixels(size: tuple[int, int], where: str, name: str, max_pixels: int | None, pillows: int | None) -> None:
    """A RunError when an image of ``size`` has more pixels than ``max_pixels``
    (``data.max_image_pixels``), or by default than Pillow's decompression-bomb limit."""
    limit = max_pixels if max_pixels is not None else None if pillows is None else 2 * pillows
    width, height = size
    if limit is None or width * height <= limit:
        return
    which = ("data.max_image_pixels" if max_pixels is not None
             else "Pillow's decompression-bomb limit; data.max_image_pixels is unset")
    verb = "are" if name.startswith("its bytes") else "is"
    raise RunError(f"{where}: {name} {verb} {width} x {height} pixels ({width * height:,}), more than the limit of "
                   f"{limit:,} ({which}): a small file that decodes to that many pixels can exhaust the run's "
                   f"memory. If you trust the data, set data.max_image_pixels to {width * height} or more")


def _open(value: Any, where: str, max_pixels: int | None = None):
    """One cell entry as an RGB PIL image, or a RunError naming ``where`` and what is valid;
    an image of more than ``max_pixels`` pixels (None: Pillow's limit) is refused from its
    header, before it is decoded."""
    from PIL import Image, UnidentifiedImageError

    if isinstance(value, Image.Image):
        with _GUARD:
            _check_pixels(value.size, where, "the PIL image", max_pixels, Image.MAX_IMAGE_PIXELS)
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
    name = f"'{source}'"
    if isinstance(source, io.BytesIO):
        name = f"its bytes ({value['path']!r})" if value.get("path") else "its bytes"
    try:
        with _own_guard() as pillows, Image.open(source) as image:  # the header only
            _check_pixels(image.size, where, name, max_pixels, pillows)
            image.load()
            return image.convert("RGB")
    except (UnidentifiedImageError, OSError, ValueError) as exc:
        raise RunError(f"{where}: cannot read {name} as an image ({type(exc).__name__}: {exc})") from exc


def load_row_images(rows: list[dict], column: str, split: str, max_pixels: int | None = None) -> list[list[Any]]:
    """Every row's images (a list per row, possibly empty), loaded and checked; the first bad
    one raises a RunError naming its row, the column and what is valid. ``max_pixels``:
    ``data.max_image_pixels`` (None: Pillow's decompression-bomb limit)."""
    if rows and column not in rows[0]:
        raise RunError(f"data.image_column needs column '{column}', which the {split} data does not have; "
                       f"its columns are: {', '.join(rows[0])}")
    out = []
    for index, row in enumerate(rows):
        cell = row.get(column)
        values = [] if cell is None else list(cell) if isinstance(cell, (list, tuple)) else [cell]
        where = f"data.image_column '{column}', {split} row {index}"
        out.append([_open(value, where, max_pixels) for value in values])
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
