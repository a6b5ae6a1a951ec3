"""Prompts with images: what a prompt's images add to its token ids, and how the prompts of a
batch become the keyword arguments of an image-text-to-text model's forward.

A prompt rendered by a processor (``data.image_column``) is its token ids, in which the
processor expanded each image placeholder into the tokens the model fills with the image's
features, plus the processor's tensors. Those come in two kinds, told apart by their shape:

- per-token tensors, one value per prompt token (``mm_token_type_ids`` of Qwen2-VL), which a
  batch left-pads like the ids and extends with zeros over the completion tokens;
- per-image tensors (``pixel_values``, ``image_grid_thw``, ``pixel_attention_mask``,
  ``image_sizes``), which a batch concatenates along their first dimension, in row order:
  each model's own forward finds the features of its rows' images in that order, as it does
  for a batch its processor made.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

#: Processor outputs that are not model inputs carried with a prompt (the ids and mask are the
#: prompt's own).
_NOT_CARRIED = ("input_ids", "attention_mask")


@dataclass
class PromptImages:
    """The images of one prompt and the processor's tensors for them.

    Attributes:
        images: the images (PIL), in the order of their placeholders: for a backend that takes
            raw images (vLLM's ``multi_modal_data``).
        per_image: tensors concatenated across prompts along dim 0 (``pixel_values`` ...).
        per_token: 1-D tensors with one value per prompt token (``mm_token_type_ids``).
        text_ids: the prompt's tokens before the processor expanded its image placeholders
            (the chat template's text tokenized), for a backend whose engine expands them
            itself (vLLM); the prompt's ids are the expanded ones.
    """

    images: list[Any]
    per_image: dict[str, Tensor] = field(default_factory=dict)
    per_token: dict[str, Tensor] = field(default_factory=dict)
    text_ids: list[int] | None = None

    @classmethod
    def from_processor(cls, images: list[Any], encoded: Any, text_ids: list[int] | None = None) -> PromptImages:
        """From a processor's output for one prompt (batch of 1, ``return_tensors="pt"``)."""
        length = int(encoded["input_ids"].shape[-1])
        per_image, per_token = {}, {}
        for key, value in encoded.items():
            if key in _NOT_CARRIED or not isinstance(value, Tensor):
                continue
            if value.dim() == 2 and value.shape == (1, length):
                per_token[key] = value[0]
            else:
                per_image[key] = value
        return cls(list(images), per_image, per_token, None if text_ids is None else list(text_ids))


def image_inputs(prompts: Sequence[PromptImages | None], prompt_mask: Tensor, completion_width: int = 0
                 ) -> dict[str, Tensor]:
    """The image keyword arguments of a forward over ``n`` rows.

    Args:
        prompts: each row's prompt images (None: a row without images), ``n`` of them.
        prompt_mask: ``bool (n, L)`` the rows' left-padded prompt mask; a per-token tensor's
            values land on its row's ``True`` positions (so trimmed padding columns are fine).
        completion_width: columns after the prompt (the completion tokens), where per-token
            tensors are 0 (text).

    Returns:
        ``{name: tensor}`` on ``prompt_mask``'s device: per-token tensors ``(n, L + width)``,
        per-image tensors concatenated; empty when no row has images.
    """
    if all(p is None for p in prompts):
        return {}
    device = prompt_mask.device
    out: dict[str, Tensor] = {}
    names = dict.fromkeys(k for p in prompts if p is not None for k in p.per_image)
    for name in names:
        parts = [p.per_image[name] for p in prompts if p is not None and name in p.per_image]
        out[name] = torch.cat(parts).to(device)
    token_names = dict.fromkeys(k for p in prompts if p is not None for k in p.per_token)
    rows, width = prompt_mask.shape
    for name in token_names:
        sample = next(p.per_token[name] for p in prompts if p is not None and name in p.per_token)
        full = torch.zeros((rows, width + completion_width), dtype=sample.dtype, device=device)
        for row, prompt in enumerate(prompts):
            if prompt is None or name not in prompt.per_token:
                continue
            values = prompt.per_token[name].to(device)
            positions = prompt_mask[row].nonzero().squeeze(1)
            if len(positions) != len(values):
                raise ValueError(f"image inputs: row {row}'s '{name}' has {len(values)} values for "
                                 f"{len(positions)} prompt tokens")
            full[row, positions] = values
        out[name] = full
    return out


def repeat_rows(prompts: Sequence[PromptImages | None], times: int) -> list[PromptImages | None]:
    """Each prompt's images ``times`` times in a row (one entry per completion row)."""
    return [p for p in prompts for _ in range(times)]


#: Config attributes naming the tokens a vision-language model fills with image (or video)
#: features (Qwen2-VL, SmolVLM/Idefics3, Gemma 3: ``image_token_id``; LLaVA: ``image_token_index``).
PLACEHOLDER_ATTRIBUTES = ("image_token_id", "video_token_id", "image_token_index", "video_token_index")


def placeholder_ids(config: Any) -> list[int]:
    """The ids of the tokens ``config``'s model fills with image or video features."""
    found = (getattr(config, name, None) for name in PLACEHOLDER_ATTRIBUTES)
    return sorted({int(v) for v in found if isinstance(v, int)})


def without_placeholders(completion_ids: Tensor, mask: Tensor, config: Any) -> tuple[Tensor, Tensor]:
    """``(ids, mask)`` where a completion that wrote an image placeholder token is left out
    of the loss (its mask all False) and its placeholders are replaced by another token.

    A model's forward fills every placeholder of its input with an image's features and
    refuses more placeholders than images; a completion holding one (a random model writes
    them, a trained one does not) cannot be scored the way it was sampled (generation fed it
    back as a plain token), so it trains nothing, like a truncated completion."""
    ids = placeholder_ids(config)
    if not ids:
        return completion_ids, mask
    found = torch.isin(completion_ids, torch.tensor(ids, device=completion_ids.device)) & mask
    if not bool(found.any()):
        return completion_ids, mask
    other = next(i for i in range(len(ids) + 1) if i not in ids)
    rows = found.any(dim=1)
    return completion_ids.masked_fill(found, other), mask & ~rows[:, None]


def generation_positions(model: Any, ids: Tensor, mask: Tensor, inputs: dict[str, Tensor], cache: Any = None
                         ) -> Tensor:
    """The position ids transformers ``generate`` gives the rows ``ids (b, S)`` (left-padded
    ``mask``) of a model: the model's own rule (``_prepare_position_ids_for_generation``): from
    the mask for most models, Qwen2-VL's 3-D ones from the image grids in ``inputs`` (which it
    stores as per-row offsets), or, after a ``cache`` of the prompts, the text positions plus
    those offsets. ``(b, S)``, or ``(k, b, S)`` for a model with several position axes."""
    plain = model.get_base_model() if hasattr(model, "get_base_model") else model
    plain = getattr(plain, "module", plain)
    kwargs = {"attention_mask": mask.long(), **inputs}
    if cache is not None:
        kwargs["cache"] = cache
    return plain._prepare_position_ids_for_generation(ids, kwargs)


def repeat_position_state(model: Any, prompts: int, group_size: int) -> None:
    """Repeat each row of any ``rope_deltas`` tensor the model's modules hold for ``prompts``
    rows ``group_size`` times (rows prompt-major), as a prompt's KV cache is for its group
    (Qwen2-VL keeps the offset of each row's text positions after its images there, and adds
    it to the positions of the tokens that follow a cache)."""
    for module in model.modules():
        deltas = getattr(module, "rope_deltas", None)
        if isinstance(deltas, Tensor) and deltas.shape[0] == prompts:
            module.rope_deltas = deltas.repeat_interleave(group_size, 0)
