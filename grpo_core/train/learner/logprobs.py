"""Log-probabilities of sampled completion tokens under a causal LM.

:func:`completion_logprobs` runs the decoder on prompts plus completions (padded, or packed
into one padding-free sequence: :mod:`grpo_core.train.learner.packing`) and sends only the positions
that predict a completion token through the output layer, chunk by chunk
(:func:`grpo_core.train.learner.head_logprobs.token_logprobs`: never a ``(B, T, V)`` copy).

Public functions:

- :func:`completion_logprobs`: ``(B, T)`` log-probs (and entropies) of the completion tokens.
- :func:`token_logprobs`, :func:`logit_transform`: the output layer's part, re-exported from
  :mod:`grpo_core.train.learner.head_logprobs`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from grpo_core.contracts.images import generation_positions, image_inputs, repeat_position_state, repeat_rows
from grpo_core.errors import RunError
from grpo_core.train.learner.head_logprobs import DEFAULT_CHUNK_SIZE, logit_transform, token_logprobs
from grpo_core.train.learner.packing import pack_rows, packed_decoder_call, packing_unsupported
from grpo_core.train.learner.routing import Replay, replayed, route_keys

__all__ = ["token_logprobs", "completion_logprobs", "logit_transform", "DEFAULT_CHUNK_SIZE"]


# --------------------------------------------------------------------------- full model
def _position_ids(mask: Tensor) -> Tensor:
    """``long (b, S)`` positions of a left-padded ``bool (b, S)`` mask: 0, 1, ... from each
    row's first real token, 0 on padding (what ``generate`` computes from the mask)."""
    pos = mask.long().cumsum(-1) - 1
    return pos.masked_fill(~mask, 0)


def _shares_prompt_safely(model: Any, decoder: nn.Module, group_size: int) -> bool:
    """Whether the prompt can be encoded once and its cache expanded ``G`` times.

    Not when ``G == 1`` (nothing to share), under gradient checkpointing in training
    (transformers then drops the cache), or with sliding-window attention (the cache keeps
    only the window, which the expansion trick does not model)."""
    if group_size == 1:
        return False
    if decoder.training and any(
        getattr(m, "gradient_checkpointing", False) for m in decoder.modules()
    ):
        return False
    config = (
        model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    )
    layer_types = getattr(config, "layer_types", None) or ()
    if any("sliding" in str(kind) for kind in layer_types):
        return False
    if getattr(config, "sliding_window", None) is not None:
        return getattr(config, "use_sliding_window", True) is False
    return True


def _hidden_plain(decoder, prompt_ids, prompt_mask, completion_ids, group_size) -> Tensor:
    """Decoder on ``concat(prompt repeated G times, completion)``.

    Shapes: prompt ``(P, L)``, completion ``(B, T)``. Returns ``(B, T, H)``: the hidden
    state that predicts each completion token (last prompt position, then completion
    positions but the last)."""
    ids = torch.cat([prompt_ids.repeat_interleave(group_size, 0), completion_ids], dim=1)
    comp_attn = torch.ones_like(completion_ids, dtype=torch.bool)
    mask = torch.cat([prompt_mask.repeat_interleave(group_size, 0), comp_attn], dim=1)
    out = decoder(
        input_ids=ids, attention_mask=mask, position_ids=_position_ids(mask), use_cache=False
    )
    length, steps = prompt_ids.shape[1], completion_ids.shape[1]
    return out.last_hidden_state[:, length - 1 : length - 1 + steps]


def image_text_body(model: Any) -> nn.Module:
    """The body of an image-text-to-text model (its forward takes the image inputs and returns
    the last hidden states): the base model under a peft or DDP wrapper, then its
    ``base_model_prefix`` module (``model`` of Qwen2-VL and SmolVLM)."""
    plain = getattr(model, "module", model)
    if hasattr(plain, "get_base_model"):
        plain = plain.get_base_model()
    return getattr(plain, plain.base_model_prefix)


def _hidden_images(model, prompt_ids, prompt_mask, completion_ids, group_size, images) -> Tensor:
    """:func:`_hidden_plain` for prompts with images: the model's own body runs every row
    (prompt then completion) with its prompt's image inputs, so that the image features and
    the positions (Qwen2-VL's 3-D ones) are the model's; no prompt is shared. ``images``: one
    :class:`~grpo_core.contracts.PromptImages` (or None) per prompt. Returns ``(B, T, H)``."""
    ids = torch.cat([prompt_ids.repeat_interleave(group_size, 0), completion_ids], dim=1)
    row_mask = prompt_mask.repeat_interleave(group_size, 0)
    mask = torch.cat([row_mask, torch.ones_like(completion_ids, dtype=torch.bool)], dim=1)
    inputs = image_inputs(repeat_rows(images, group_size), row_mask, completion_ids.shape[1])
    out = image_text_body(model)(input_ids=ids, attention_mask=mask, use_cache=False, **inputs)
    length, steps = prompt_ids.shape[1], completion_ids.shape[1]
    return out.last_hidden_state[:, length - 1 : length - 1 + steps]


def _hidden_images_shared(model, prompt_ids, prompt_mask, completion_ids, group_size, images) -> Tensor | None:
    """:func:`_hidden_images` with each prompt (its images included) encoded once: its keys and
    values, and the model's per-row position state (Qwen2-VL's offsets), repeated ``G`` times
    for the completions, which continue from them; gradients flow back through the
    repetition. Positions are the ones ``generate`` gives (the model's own rule,
    :func:`~grpo_core.contracts.images.generation_positions`), prompt and completions alike.
    Returns ``(B, T, H)``, or None if the body kept no cache."""
    from transformers import DynamicCache

    body, length, steps = image_text_body(model), prompt_ids.shape[1], completion_ids.shape[1]
    inputs = image_inputs(images, prompt_mask)
    positions = generation_positions(model, prompt_ids, prompt_mask, inputs)
    cache = DynamicCache(config=model.config.get_text_config(decoder=True))
    prompt = body(input_ids=prompt_ids, attention_mask=prompt_mask, position_ids=positions, past_key_values=cache,
                  use_cache=True, **inputs)
    if cache.get_seq_length() != length:
        return None
    cache.batch_repeat_interleave(group_size)
    repeat_position_state(model, prompt_ids.shape[0], group_size)
    rows_mask = prompt_mask.repeat_interleave(group_size, 0)
    mask = torch.cat([rows_mask, torch.ones_like(completion_ids, dtype=torch.bool)], dim=1)
    ids = torch.cat([prompt_ids.repeat_interleave(group_size, 0), completion_ids], dim=1)
    following = generation_positions(model, ids, mask, {}, cache)[..., length:]
    text = {k: v[:, length:] for k, v in image_inputs(repeat_rows(images, group_size), rows_mask, steps).items()
            if v.dim() == 2 and v.shape == ids.shape}  # per-token inputs of the completions (text: 0)
    comp = body(input_ids=completion_ids, attention_mask=mask, position_ids=following, past_key_values=cache,
                use_cache=True, **text).last_hidden_state
    last = prompt.last_hidden_state[:, -1:].repeat_interleave(group_size, 0)
    return torch.cat([last, comp[:, :-1]], dim=1)


def _hidden_with_images(model, decoder, prompt_ids, prompt_mask, completion_ids, group_size, images,
                        share_prompt: bool, prompt_index: Tensor | None) -> Tensor:
    """``(B, T, H)`` for prompts with images: each prompt encoded once for its group where that
    is safe (:func:`_hidden_images_shared`), else every row whole (:func:`_hidden_images`);
    ``group_size`` None: one prompt row per completion (``prompt_index``)."""
    if group_size is None:
        prompt_ids, prompt_mask, group_size = prompt_ids[prompt_index], prompt_mask[prompt_index], 1
        images = [images[int(i)] for i in prompt_index]
    hidden = None
    if share_prompt and _shares_prompt_safely(model, decoder, group_size):
        hidden = _hidden_images_shared(model, prompt_ids, prompt_mask, completion_ids, group_size, images)
    if hidden is None:
        hidden = _hidden_images(model, prompt_ids, prompt_mask, completion_ids, group_size, images)
    return hidden


def _length_buckets(lengths: Tensor, min_saving: float = 0.2, max_buckets: int = 4) -> list[Tensor] | None:
    """Rows grouped by length so that a forward of each group, trimmed to its longest row,
    skips most padding: rows sorted longest first, a new group started when a row is at most
    half the current group's longest. Rows of length 0 are in no group (nothing to compute).

    ``lengths``: ``long (B,)``. Returns the row indices of each group, or None when grouping
    would save less than ``min_saving`` of the ``B * max(lengths)`` positions (or make
    more than ``max_buckets`` groups is the only way to): one padded forward is then cheaper."""
    order = torch.argsort(lengths, descending=True, stable=True)
    sizes = lengths[order].tolist()
    if not sizes or sizes[0] == 0:
        return None
    groups, start = [], 0
    for i, size in enumerate(sizes):
        if size == 0 or (i > start and size * 2 <= sizes[start] and len(groups) < max_buckets - 1):
            groups.append(order[start:i])
            start = i
            if size == 0:
                break
    else:
        groups.append(order[start:])
    kept = [g for g in groups if len(g) and int(lengths[g[0]]) > 0]
    padded = sum(len(g) * int(lengths[g[0]]) for g in kept)
    if padded > (1 - min_saving) * len(sizes) * sizes[0]:
        return None
    return kept


def _encode_prompts(decoder, config, prompt_ids, prompt_mask):
    """The prompts' last hidden states ``(P, L, H)`` and their KV cache, or None when the
    decoder kept no cache."""
    from transformers import DynamicCache

    if hasattr(config, "get_text_config"):
        config = config.get_text_config(decoder=True)
    out = decoder(
        input_ids=prompt_ids,
        attention_mask=prompt_mask,
        position_ids=_position_ids(prompt_mask),
        past_key_values=DynamicCache(config=config),
        use_cache=True,
    )
    cache = out.past_key_values
    if cache is None or cache.get_seq_length() != prompt_ids.shape[1]:
        return None
    return out.last_hidden_state, cache, config


def _continue(decoder, cache, prompt_mask, completion_ids) -> Tensor:
    """Completions ``(b, T)`` after their prompts' cache (``b`` rows, masks ``(b, L)``);
    returns their hidden states ``(b, T, H)``."""
    mask = torch.cat([prompt_mask, torch.ones_like(completion_ids, dtype=torch.bool)], dim=1)
    start = prompt_mask.long().sum(-1)  # (b,)
    positions = start[:, None] + torch.arange(completion_ids.shape[1], device=completion_ids.device)[None, :]
    return decoder(
        input_ids=completion_ids, attention_mask=mask, position_ids=positions,
        past_key_values=cache, use_cache=True,
    ).last_hidden_state


def _hidden_shared(
    decoder, config, prompt_ids, prompt_mask, completion_ids, group_size, lengths=None
) -> Tensor | None:
    """Like :func:`_hidden_plain`, but each prompt is encoded once: its keys and values
    (``P`` rows) are repeated ``G`` times and the completions attend to them; gradients flow
    back through the repetition. With ``lengths`` (``long (B,)``: each row's last needed
    position + 1) rows of very different lengths run in groups (:func:`_length_buckets`),
    each trimmed to its longest row; positions past a row's length are then zeros.
    Returns ``(B, T, H)``, or None if the decoder kept no cache."""
    encoded = _encode_prompts(decoder, config, prompt_ids, prompt_mask)
    if encoded is None:
        return None
    prompt_hidden, cache, config = encoded
    last_prompt = prompt_hidden[:, -1:]  # (P, 1, H)
    buckets = _length_buckets(lengths) if lengths is not None else None
    if buckets is None:
        cache.batch_repeat_interleave(group_size)
        comp = _continue(decoder, cache, prompt_mask.repeat_interleave(group_size, 0), completion_ids)
        return torch.cat([last_prompt.repeat_interleave(group_size, 0), comp[:, :-1]], dim=1)
    return _hidden_bucketed(decoder, config, cache, last_prompt, prompt_mask, completion_ids, group_size,
                            lengths, buckets)


def _hidden_bucketed(decoder, config, cache, last_prompt, prompt_mask, completion_ids, group_size,
                     lengths, buckets) -> Tensor:
    """:func:`_hidden_shared` for rows in length groups: each group's prompt cache rows are
    selected from the ``P`` encoded prompts (gradients flow back through the selection)."""
    from transformers import DynamicCache

    layers = [(layer.keys, layer.values) for layer in cache.layers]
    steps, pieces, order = completion_ids.shape[1], [], []
    for rows in buckets:
        prompt_of = rows // group_size
        sub = DynamicCache(config=config)
        for index, (keys, values) in enumerate(layers):
            sub.update(keys[prompt_of], values[prompt_of], index)
        width = int(lengths[rows[0]])
        comp = _continue(decoder, sub, prompt_mask[prompt_of], completion_ids[rows, :width])
        hidden = torch.cat([last_prompt[prompt_of], comp[:, : width - 1]], dim=1)  # (b, width, H)
        pieces.append(torch.nn.functional.pad(hidden, (0, 0, 0, steps - width)))
        order.append(rows)
    order = torch.cat(order)
    skipped = torch.ones(completion_ids.shape[0], dtype=torch.bool, device=order.device)
    skipped[order] = False
    if skipped.any():  # rows with nothing to compute
        idle = skipped.nonzero().squeeze(1)
        pieces.append(pieces[0].new_zeros((len(idle), steps, pieces[0].shape[-1])))
        order = torch.cat([order, idle])
    return torch.cat(pieces)[torch.argsort(order)]


def _trim(prompt_ids, prompt_mask, completion_ids, completion_mask):
    """Drop prompt columns that are padding in every row (left) and completion columns past
    the last masked token of every row (right). Returns the four tensors and ``T_kept``."""
    keep = prompt_mask.any(0).nonzero()
    first = int(keep[0]) if keep.numel() else prompt_ids.shape[1]
    if first == prompt_ids.shape[1]:
        raise ValueError("completion_logprobs: every prompt is empty (prompt_mask is all False)")
    cols = completion_mask.any(0).nonzero()
    steps = int(cols[-1]) + 1 if cols.numel() else 0
    return (
        prompt_ids[:, first:],
        prompt_mask[:, first:],
        completion_ids[:, :steps],
        completion_mask[:, :steps],
        steps,
    )


def _groups(num_prompts: int, num_rows: int, prompt_index: Tensor | None) -> tuple[int | None, Tensor]:
    """``(G, prompt_index)``: the rows' group size when they are ``G`` consecutive rows per
    prompt (None otherwise) and the prompt of each row."""
    if prompt_index is None:
        if num_prompts == 0 or num_rows % num_prompts:
            raise ValueError(
                f"completion_logprobs: {num_rows} completion rows are not a multiple of "
                f"{num_prompts} prompts"
            )
        return num_rows // num_prompts, torch.arange(num_prompts).repeat_interleave(num_rows // num_prompts)
    if prompt_index.shape != (num_rows,) or (num_rows and not 0 <= int(prompt_index.min()) <= int(
            prompt_index.max()) < num_prompts):
        raise ValueError(f"completion_logprobs: prompt_index must be ({num_rows},) with values in "
                         f"[0, {num_prompts}); got {tuple(prompt_index.shape)}")
    prompt_index = prompt_index.long().cpu()
    uniform = num_prompts and num_rows % num_prompts == 0 and torch.equal(
        prompt_index, torch.arange(num_prompts).repeat_interleave(num_rows // num_prompts))
    return (num_rows // num_prompts if uniform else None), prompt_index


def _hidden_padded(model, decoder, p_ids, p_mask, c_ids, c_mask, group_size, share_prompt, length_buckets):
    """``(B, T, H)``: the hidden states that predict each completion token, from the padded
    layout (prompt shared by its group where safe, rows in length buckets)."""
    hidden = None
    if share_prompt and _shares_prompt_safely(model, decoder, group_size):
        positions = torch.arange(1, c_mask.shape[1] + 1, device=c_mask.device)
        lengths = (c_mask.long() * positions).amax(dim=1)  # last masked position + 1, 0 if none
        hidden = _hidden_shared(decoder, model.config, p_ids, p_mask, c_ids, group_size,
                                lengths if length_buckets else None)
    if hidden is None:
        hidden = _hidden_plain(decoder, p_ids, p_mask, c_ids, group_size)
    return hidden


def _hidden_replayed(model, decoder, p_ids, p_mask, c_ids, c_mask, group_size, prompt_index, packed, routes, keys
                     ) -> Tensor:
    """The hidden states ``(n, H)`` that predict the masked completion tokens, with the recorded
    routes forced (:func:`~grpo_core.train.learner.routing.replayed`) in one decoder call: the
    packed sequence, or the padded block with each row's prompt before it (:func:`_hidden_plain`).
    ``keys``: the numbers of the (trimmed) prompt and completion tokens
    (:func:`~grpo_core.train.learner.routing.route_keys`), laid out as the ids are."""
    p_keys, c_keys = keys
    if packed and packing_unsupported(model, decoder) is None:
        layout = pack_rows(p_ids, p_mask, c_ids, c_mask, prompt_index)
        numbers = pack_rows(p_keys, p_mask, c_keys, c_mask, prompt_index).input_ids
        with replayed(model, routes.at(numbers), routes.tally):
            return packed_decoder_call(decoder, layout)[layout.hidden_index[c_mask]]
    if group_size is None:  # rows that are not whole groups: one prompt row per completion
        p_ids, p_mask, p_keys, group_size = p_ids[prompt_index], p_mask[prompt_index], p_keys[prompt_index], 1
    numbers = torch.cat([p_keys.repeat_interleave(group_size, 0), c_keys], dim=1)
    with replayed(model, routes.at(numbers), routes.tally):
        return _hidden_plain(decoder, p_ids, p_mask, c_ids, group_size)[c_mask]


def completion_logprobs(
    model: Any,
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    completion_ids: Tensor,
    completion_mask: Tensor,
    *,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    with_entropy: bool = False,
    temperature: float = 1.0,
    share_prompt: bool = True,
    length_buckets: bool = True,
    packed: bool = False,
    prompt_index: Tensor | None = None,
    images: list | None = None,
    routes: Replay | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Log-probs (and entropies) of completion tokens under a causal LM, ``(B, T)`` each.

    Runs ``model.get_decoder()`` (the body without the LM head) on each prompt followed by
    each of its ``G = B // P`` completions, with position ids counted from each row's first
    real token (left padding; the same ids ``generate`` uses), then applies the LM head
    only at the positions that predict a masked completion token, in chunks
    (:func:`token_logprobs`). Padding columns shared by all rows are trimmed first.

    With ``share_prompt`` each prompt is encoded once (``P`` rows) and its key/value cache
    repeated ``G`` times for the completions, gradients flowing through it; it falls back to
    encoding ``prompt x G`` rows when that is unsafe (see :func:`_shares_prompt_safely`).
    The two give equal results up to float rounding. With ``length_buckets`` (and a shared
    prompt) rows whose lengths differ widely run in up to 4 groups, each trimmed to its
    longest row, when that skips at least a fifth of the padded positions; rows with no
    masked token are not run at all. Again equal up to float rounding.

    ``completion_mask`` selects which outputs are computed; every completion token up to a
    row's last masked one is attended to, so a mask with holes (e.g. tool output excluded
    from the loss) still conditions on those tokens. Logits are divided by ``temperature``
    (TRL's convention: the log-probs of the sampling distribution, before top-k/top-p), and
    scaled / soft-capped per :func:`logit_transform` of ``model.config``.

    With ``packed`` the rows run as one padding-free sequence instead
    (:mod:`grpo_core.train.learner.packing`: each prompt once, then its completions, attention that
    never crosses rows), equal to the padded result up to float rounding; where packing cannot
    be exact (:func:`~grpo_core.train.learner.packing.packing_unsupported`) the padded path runs.

    Args:
        model: a transformers causal LM (``get_decoder()``, ``get_output_embeddings()``).
        prompt_ids: ``long (P, L)`` left-padded prompts, each once.
        prompt_mask: ``bool (P, L)``.
        completion_ids: ``long (B, T)`` right-padded completions, rows prompt-major (``G = B // P``
            consecutive rows per prompt) unless ``prompt_index`` says otherwise.
        completion_mask: ``bool (B, T)`` tokens whose log-prob is wanted.
        chunk_size: rows of the LM head evaluated at once.
        with_entropy: also return per-token entropies.
        temperature: sampling temperature (> 0).
        share_prompt: encode each prompt once instead of ``G`` times.
        length_buckets: group rows by length (with ``share_prompt``).
        packed: run the rows packed into one sequence (see above).
        prompt_index: ``long (B,)`` the prompt of each completion, for rows that are not whole
            groups of equal size (default: ``G`` consecutive rows per prompt).
        images: ``P`` :class:`~grpo_core.contracts.PromptImages` (or None each) for prompts with
            images: the rows then run through the image-text-to-text model's own body with
            their prompt's image inputs, each prompt encoded once where ``share_prompt`` allows
            (:func:`_hidden_images_shared`, else :func:`_hidden_images`); never packed.
        routes: for a mixture-of-experts policy, the experts the sampler routed the ``P``
            prompts' and ``B`` rows' tokens to (routing replay, :mod:`grpo_core.train.learner.routing`),
            forced in one decoder call (:func:`_hidden_replayed`): the padded path then encodes
            each row's prompt with it, the packed one each prompt once as ever.

    Returns:
        ``(logp, entropy)``: ``float32 (B, T)`` (float64 for a float64 model), exactly 0
        where ``completion_mask`` is False; ``entropy`` None unless ``with_entropy``.
    """
    group_size, prompt_index = _groups(prompt_ids.shape[0], completion_ids.shape[0], prompt_index)
    prompt_mask, completion_mask = prompt_mask.bool(), completion_mask.bool()
    p_ids, p_mask, c_ids, c_mask, steps = _trim(
        prompt_ids, prompt_mask, completion_ids, completion_mask
    )
    head = model.get_output_embeddings()
    dtype = torch.promote_types(head.weight.dtype, torch.float32)
    logp = torch.zeros(completion_ids.shape, dtype=dtype, device=completion_ids.device)
    entropy = torch.zeros_like(logp) if with_entropy else None
    if steps == 0:
        return logp, entropy
    decoder = model.get_decoder()
    if routes is not None:
        if images is not None:
            raise RunError("algorithm.routing_replay: prompts with images are not replayed yet")
        p_keys, c_keys = route_keys(prompt_ids, completion_ids)
        p_keys, _, c_keys, _, _ = _trim(p_keys, prompt_mask, c_keys, completion_mask)
        hidden = _hidden_replayed(model, decoder, p_ids, p_mask, c_ids, c_mask, group_size, prompt_index, packed,
                                  routes, (p_keys, c_keys))
    elif images is not None:
        hidden = _hidden_with_images(model, decoder, p_ids, p_mask, c_ids, group_size, images, share_prompt,
                                     prompt_index)[c_mask]
    elif packed and packing_unsupported(model, decoder) is None:
        layout = pack_rows(p_ids, p_mask, c_ids, c_mask, prompt_index)
        hidden = packed_decoder_call(decoder, layout)[layout.hidden_index[c_mask]]
    else:
        if group_size is None:  # rows that are not whole groups: one prompt row per completion
            p_ids, p_mask, group_size = p_ids[prompt_index], p_mask[prompt_index], 1
        hidden = _hidden_padded(model, decoder, p_ids, p_mask, c_ids, c_mask, group_size, share_prompt,
                                length_buckets)[c_mask]
    flat_logp, flat_ent = token_logprobs(
        hidden,
        head,
        c_ids[c_mask],
        chunk_size=chunk_size,
        with_entropy=with_entropy,
        temperature=temperature,
        **logit_transform(model.config),
    )
    full_mask = torch.zeros_like(completion_mask)
    full_mask[:, :steps] = c_mask
    logp = logp.masked_scatter(full_mask, flat_logp.to(dtype))
    if with_entropy:
        entropy = entropy.masked_scatter(full_mask, flat_ent.to(dtype))
    return logp, entropy
