"""The ``hf`` backend's prompts with images: each prompt (its image features included)
encoded once and its KV cache repeated for the ``G`` completions of its group, as for text
prompts (:meth:`grpo_plugins.rollout.hf.HFRollout._prefill`), but through the whole
image-text-to-text model, so that the model places the image features and its positions
itself; transformers ``generate`` then continues from the cache.

A model that keeps position state between its calls (Qwen2-VL's ``rope_deltas``: the offset of
each row's text positions after its images, which ``generate`` adds to the positions of the
new tokens) gets that state repeated for the group's rows too
(:func:`~grpo_core.contracts.images.repeat_position_state`)."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from grpo_core.contracts import PromptImages, image_inputs, repeat_rows
from grpo_core.contracts.images import generation_positions, placeholder_ids, repeat_position_state

__all__ = ["row_image_inputs", "prefill_with_images"]


def row_image_inputs(images: list[PromptImages | None], mask: Tensor, group_size: int) -> dict[str, Tensor]:
    """The image inputs of the ``p*G`` rows of ``p`` prompts (left-padded ``mask (p, L)``)."""
    return image_inputs(repeat_rows(images, group_size), mask.repeat_interleave(group_size, 0))


def prefill_with_images(model: Any, ids: Tensor, mask: Tensor, images: list[PromptImages | None],
                        group_size: int) -> Any | None:
    """Encode ``p`` prompts ``(p, L)`` minus their last token once, with their images, through
    the whole model; return the cache with every row repeated ``G`` times (``generate`` then
    feeds only each prompt's last token, without the image inputs). None (nothing shared) when
    a prompt's last token is an image placeholder (its features would be needed again)."""
    from transformers import DynamicCache

    if bool(torch.isin(ids[:, -1], torch.tensor(placeholder_ids(model.config), device=ids.device)).any()):
        return None
    inputs = image_inputs(images, mask)
    # the positions generate gives these rows (its own rule: from the mask's left padding, or
    # Qwen2-VL's 3-D ones from the image grids), for the L - 1 positions prefilled
    positions = generation_positions(model, ids, mask, inputs)
    for name, value in inputs.items():  # per-token inputs cover the L columns: drop the last
        if value.dim() == 2 and value.shape == ids.shape:
            inputs[name] = value[:, :-1]
    config = model.config.get_text_config(decoder=True)
    cache = DynamicCache(config=config)
    model(input_ids=ids[:, :-1], attention_mask=mask[:, :-1], position_ids=positions[..., :-1], past_key_values=cache,
          use_cache=True, logits_to_keep=1, **inputs)
    cache.batch_repeat_interleave(group_size)
    repeat_position_state(model, ids.shape[0], group_size)
    return cache
