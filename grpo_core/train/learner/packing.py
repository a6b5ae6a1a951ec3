"""The padding-free learner forward: the rows of a micro-batch packed into one sequence.

The padded forward runs a ``(B, T)`` block of completions, each row padded to the longest of
its micro-batch (:func:`grpo_core.train.learner.logprobs.completion_logprobs`), so its compute and
activation memory grow with ``B * max(length)``. Here the rows are laid end to end instead:

    [prompt 0][completion 0.0][completion 0.1]...[prompt 1][completion 1.0]...

one decoder call on a ``(1, N)`` sequence with ``N`` the tokens actually needed: each
prompt's real tokens once (its left padding dropped), then each of its completions up to the
token before its last masked one (the last needed token is only a target: no hidden state is
taken after it). Position ids restart in every row as in the padded layout: a prompt counts
``0 .. Lp-1`` and each of its completions ``Lp, Lp+1, ...``.

Attention never crosses rows: a prompt token attends causally to its prompt; a completion
token to its whole prompt and causally to its own completion, never to its siblings or to
another group. The G completions of a prompt share its keys and values (the prompt is
encoded once, as in the padded path's shared prompt), and gradients flow to the prompt from
all of them. :func:`segment_attention` computes this rule exactly, one attention call per
prompt and per completion (a completion's keys are its prompt's followed by its own, under
a causal mask aligned to the last key), so its cost grows with ``sum_i l_i (Lp + l_i)``,
not ``N^2``: a dense ``N x N`` block mask given to ``sdpa`` computes the whole square
(``bench/packing.py --attention`` times the two). It is registered with transformers as an
attention implementation and selected only for the packed call (:func:`packed_decoder_call`);
the layout reaches it through the keyword arguments transformers passes from the decoder's
``forward`` down to every attention call. An attention call without the layout fails
loudly, and so does a forward in which not every layer ran it (a layer mixing positions
another way would mix rows).

Where this cannot be exact the padded path runs instead (:func:`packing_unsupported`):
layers other than full attention (sliding-window, chunked, linear) and soft-capped attention.
Activation checkpointing packs too: a checkpointed layer is recomputed in the backward, after
the packed call has ended, and :func:`attention_switched` registers itself to be switched on
again around that recomputation (:mod:`grpo_core.train.recompute`), so it computes what
the forward computed. A layer checkpointed by any other function (one that would recompute with
the model's own attention) still trains padded.

On a GPU the same rule is one call per layer: :func:`flex_segment_attention` gives torch's
``flex_attention`` a block mask of the rule (:func:`segment_mask_mod`: a key is seen when it is
in the query's own segment at or before it, or in the segment of its prompt), built once per
layout and shared by every layer; ``flex_attention`` skips the blocks the mask leaves empty.
:func:`pack_rows` picks it where the sequence is on a CUDA device (``attention="flex"``), the
per-segment calls elsewhere. torch 2.13 runs ``flex_attention``'s forward on the CPU but not its
backward, so the tests check the flex forward against the per-segment one there and the mask's
gradients through a dense ``sdpa`` call of the same rule; ``bench/gpu/`` checks and times the
flex path on a GPU, where ``train.packing: auto`` still pads until that measurement says otherwise.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from grpo_core.errors import RunError
from grpo_core.train.recompute import checkpointed_otherwise, on_recompute

log = logging.getLogger(__name__)

__all__ = ["PackedRows", "pack_rows", "segment_attention", "flex_segment_attention", "segment_mask_mod",
           "packed_decoder_call", "packing_unsupported", "attention_switched",
           "PACKED_ATTENTION", "FLEX_ATTENTION", "ATTENTIONS"]

#: The name :func:`segment_attention` is registered under with transformers.
PACKED_ATTENTION = "grpo_packed"

#: The name :func:`flex_segment_attention` (one call per layer, for GPUs) is registered under.
FLEX_ATTENTION = "grpo_packed_flex"

#: The packed attention paths: ``segments`` (one ``sdpa`` call per prompt and per completion) and
#: ``flex`` (one ``flex_attention`` call per layer with the layout's block mask).
ATTENTIONS = ("segments", "flex")

#: What :func:`pack_rows` picks on a CUDA device (``bench/gpu/throughput.py`` sets it to time both).
CUDA_ATTENTION = "flex"

#: The keyword argument that carries the layout to :func:`segment_attention`.
LAYOUT_KWARG = "grpo_packed_rows"

#: Device types where ``train.packing: auto`` packs: where ``bench/packing.py`` measured it to win.
AUTO_DEVICES = ("cpu",)

#: Keyword arguments of an attention call that change its formula: packing cannot honour them.
_SPECIAL = ("softcap", "sinks", "s_aux", "position_bias", "sliding_window")


class _Tally:
    """How many attention layers ran on a layout, one count shared by every copy of it: FSDP2's
    mixed precision hands each layer a copy of the dataclasses in its keyword arguments (their
    tensors cast), so a count kept on the layout itself would grow on the copies only."""

    def __init__(self) -> None:
        self.count = 0


@dataclass
class PackedRows:
    """One micro-batch packed into a single sequence (see the module doc).

    ``input_ids`` and ``position_ids`` are ``long (1, N)``. ``segments`` tile ``0 .. N`` in
    order, one per prompt and per completion with a token to run, as ``(length, context)``:
    the segment attends to the keys of the segments listed in ``context`` (indices into
    ``segments``, earlier ones), then causally to its own; a prompt has none, a completion its
    prompt. ``hidden_index`` is ``long (B, T)``: the packed position whose hidden state predicts
    completion token ``(b, t)`` (its prompt's last token for ``t = 0``); meaningful where ``t``
    is before the row's last masked token + 1.
    """

    input_ids: Tensor
    position_ids: Tensor
    segments: list[tuple[int, tuple[int, ...]]]
    hidden_index: Tensor
    attention: str = "segments"  # which packed attention runs it: one of ATTENTIONS
    tally: _Tally = field(default_factory=_Tally, repr=False)  # attention layers run (a check: all of them)
    _masks: dict[tuple[int, int], Tensor] = field(default_factory=dict, repr=False)
    _block_masks: dict[str, Any] = field(default_factory=dict, repr=False)

    @property
    def attention_calls(self) -> int:
        """How many attention layers ran on this layout (or a copy of it) since the call began."""
        return self.tally.count

    @property
    def tokens(self) -> int:
        """``N``: the packed sequence's length."""
        return self.input_ids.shape[1]

    def causal_mask(self, context: int, length: int, device: torch.device) -> Tensor:
        """``bool (length, context + length)``: query ``j`` of a segment sees its ``context``
        keys and its own tokens ``0 .. j`` (causal, aligned to the last key). Made once per shape."""
        key = (context, length)
        if key not in self._masks:
            keys = torch.arange(context + length, device=device)
            self._masks[key] = keys[None, :] <= context + torch.arange(length, device=device)[:, None]
        return self._masks[key]


def segment_mask_mod(layout: PackedRows, device: torch.device | str):
    """The packed attention rule as a ``flex_attention`` mask function ``(b, h, q, kv) -> bool``:
    ``kv`` is seen from ``q`` when both are in one segment and ``kv <= q``, or when ``kv`` is in
    the segment of ``q``'s prompt (a prompt segment has none)."""
    lengths = torch.tensor([length for length, _ in layout.segments], dtype=torch.long, device=device)
    if any(len(context) > 1 for _, context in layout.segments):
        raise ValueError("packed attention: a segment with more than one context segment")
    context = torch.tensor([ctx[0] if ctx else -1 for _, ctx in layout.segments], dtype=torch.long, device=device)
    segment = torch.repeat_interleave(torch.arange(len(layout.segments), device=device), lengths)
    prompt = context[segment]

    def mask_mod(b, h, q, kv):
        return ((segment[q] == segment[kv]) & (kv <= q)) | (prompt[q] == segment[kv])

    return mask_mod


def block_mask(layout: PackedRows, device: torch.device):
    """``flex_attention``'s block mask of :func:`segment_mask_mod` for ``layout``, made once."""
    key = str(device)
    if key not in layout._block_masks:
        from torch.nn.attention.flex_attention import create_block_mask

        n = layout.tokens
        layout._block_masks[key] = create_block_mask(segment_mask_mod(layout, device), None, None, n, n,
                                                     device=device)
    return layout._block_masks[key]


def needed_lengths(completion_mask: Tensor) -> Tensor:
    """``long (B,)``: each row's last masked position + 1 (0 for a row with none): the
    completion tokens that must be predicted, holes included as context."""
    steps = completion_mask.shape[1]
    positions = torch.arange(1, steps + 1, device=completion_mask.device)
    return (completion_mask.long() * positions).amax(dim=1) if steps else completion_mask.new_zeros(
        completion_mask.shape[0], dtype=torch.long)


def pack_rows(prompt_ids: Tensor, prompt_mask: Tensor, completion_ids: Tensor, completion_mask: Tensor,
              prompt_index: Tensor, attention: str | None = None) -> PackedRows:
    """The packed layout of ``B`` completions of ``P`` prompts.

    Args:
        prompt_ids: ``long (P, L)`` left-padded prompts; ``prompt_mask``: ``bool (P, L)``.
        completion_ids: ``long (B, T)``; ``completion_mask``: ``bool (B, T)`` the tokens whose
            log-prob is wanted (a row runs up to its last one; a row without one does not run).
        prompt_index: ``long (B,)`` the prompt of each completion.
        attention: one of :data:`ATTENTIONS`; default :data:`CUDA_ATTENTION` (``flex``: one call
            per layer) on a CUDA device, else ``segments``.

    A prompt with no completion to run is left out; one that is needed must hold a token.
    """
    if attention is None:
        attention = CUDA_ATTENTION if completion_ids.device.type == "cuda" else "segments"
    if attention not in ATTENTIONS:
        raise ValueError(f"packing: attention must be one of {', '.join(ATTENTIONS)}, got {attention!r}")
    lengths = needed_lengths(completion_mask).tolist()
    owner = prompt_index.tolist()
    rows_of: dict[int, list[int]] = {}
    for row, prompt in enumerate(owner):
        if lengths[row] > 0:
            rows_of.setdefault(prompt, []).append(row)
    device = completion_ids.device
    ids, positions, segments = [], [], []
    prompt_last = torch.zeros(prompt_ids.shape[0], dtype=torch.long, device=device)
    row_start = torch.zeros(completion_ids.shape[0], dtype=torch.long, device=device)
    cursor = 0
    for prompt in sorted(rows_of):
        tokens = prompt_ids[prompt][prompt_mask[prompt]]
        size = tokens.shape[0]
        if size == 0:
            raise ValueError(f"packing: prompt {prompt} has no token (its prompt_mask is all False)")
        ids.append(tokens)
        positions.append(torch.arange(size, device=device))
        prompt_segment = len(segments)
        segments.append((size, ()))
        cursor += size
        prompt_last[prompt] = cursor - 1
        for row in rows_of[prompt]:
            run = lengths[row] - 1  # the last needed token is a target only
            row_start[row] = cursor
            if run == 0:
                continue
            ids.append(completion_ids[row, :run])
            positions.append(torch.arange(size, size + run, device=device))
            segments.append((run, (prompt_segment,)))
            cursor += run
    steps = completion_ids.shape[1]
    hidden_index = row_start[:, None] + torch.arange(steps, device=device)[None, :] - 1
    if steps:
        hidden_index[:, 0] = prompt_last[prompt_index.to(device)]
    empty = completion_ids.new_zeros((0,))
    return PackedRows(
        torch.cat(ids)[None] if ids else empty[None],
        torch.cat(positions)[None] if positions else empty[None],
        segments,
        hidden_index,
        attention,
    )


def _packed_layout(module: nn.Module, kwargs: dict[str, Any], attention_mask: Any, query: Tensor,
                   dropout: float | None = None) -> Any:
    """The packed layout an attention call was given, or a RuntimeError saying why packing
    cannot serve the call: no layout passed down, a mask or a special argument asked for, more
    than one sequence, or (``dropout`` given: the flex path, which takes none) dropout."""
    layout = kwargs.get(LAYOUT_KWARG)
    if layout is None:
        raise RuntimeError(
            f"packed attention: {type(module).__name__} was called without the packed layout (its model does not "
            "pass keyword arguments down to attention); set train.packing: false"
        )
    special = [k for k in _SPECIAL if kwargs.get(k) is not None]
    if special or attention_mask is not None or query.shape[0] != 1 or dropout:
        what, which = (special or "a mask", "packing") if dropout is None else (
            special or "a mask or dropout", "the flex packed attention")
        raise RuntimeError(f"packed attention: {type(module).__name__} asked for {what}, which {which} cannot "
                           "honour; set train.packing: false")
    return layout


def segment_attention(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Any,
                      dropout: float = 0.0, scaling: float | None = None, **kwargs: Any) -> tuple[Tensor, None]:
    """The attention of a packed sequence, segment by segment (the module doc's rule).

    ``query (1, heads, N, d)``, ``key``/``value (1, kv_heads, N, d)`` (after the rotary
    embedding); returns ``(1, N, heads, d)`` as transformers' attention functions do. The
    layout comes in ``kwargs[LAYOUT_KWARG]`` (a :class:`PackedRows`)."""
    layout = _packed_layout(module, kwargs, attention_mask, query)
    layout.tally.count += 1
    heads, kv_heads = query.shape[1], key.shape[1]
    if heads != kv_heads:  # grouped-query attention: each key/value head serves heads // kv_heads queries
        key = key.repeat_interleave(heads // kv_heads, dim=1)
        value = value.repeat_interleave(heads // kv_heads, dim=1)
    # One split per tensor (its backward is one concatenation), not a slice per segment (whose
    # backward writes a zero-filled tensor of the whole sequence each).
    sizes = [length for length, _ in layout.segments]
    queries, keys, values = (t.split(sizes, dim=2) for t in (query, key, value))
    pieces = []
    for i, (length, context) in enumerate(layout.segments):
        if not context:
            pieces.append(F.scaled_dot_product_attention(queries[i], keys[i], values[i], dropout_p=dropout,
                                                         is_causal=True, scale=scaling))
            continue
        k = torch.cat([*(keys[j] for j in context), keys[i]], dim=2)
        v = torch.cat([*(values[j] for j in context), values[i]], dim=2)
        mask = layout.causal_mask(k.shape[2] - length, length, query.device)
        pieces.append(F.scaled_dot_product_attention(queries[i], k, v, attn_mask=mask, dropout_p=dropout,
                                                     scale=scaling))
    out = torch.cat(pieces, dim=2) if pieces else query
    return out.transpose(1, 2).contiguous(), None


_COMPILED: dict[str, Any] = {}

#: The smallest head dimension compiled ``flex_attention`` takes on CUDA (torch 2.11's inductor
#: refused ``E=8`` in ``bench/gpu/``); smaller heads (test models) are zero-padded up to it, on
#: every device, so that the CPU tests run the padded form the GPU runs.
FLEX_MIN_HEAD_DIM = 16


def flex_segment_attention(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Any,
                           dropout: float = 0.0, scaling: float | None = None, **kwargs: Any) -> tuple[Tensor, None]:
    """:func:`segment_attention`'s rule in one ``flex_attention`` call over the whole packed
    sequence, with the layout's block mask (:func:`block_mask`; grouped-query heads served by
    ``enable_gqa``). Compiled on CUDA (``torch.compile``, shapes dynamic), where the fused kernel
    is what makes it one call; eager elsewhere (torch 2.13: forward only on a CPU). Should the
    compiler fail, the process warns once and runs :func:`segment_attention` from then on."""
    layout = _packed_layout(module, kwargs, attention_mask, query, dropout=dropout)
    layout.tally.count += 1
    head_dim = query.shape[-1]
    if scaling is None:
        scaling = head_dim ** -0.5
    run = _flex_runner(query.device)
    if run is None:  # the compiler failed once in this process: the per-segment calls, exact too
        layout.tally.count -= 1
        return segment_attention(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    padded = (query, key, value)
    if head_dim < FLEX_MIN_HEAD_DIM:  # the compiled kernel's floor: zero columns leave q.k and the output unchanged
        pad = (0, FLEX_MIN_HEAD_DIM - head_dim)
        padded = tuple(F.pad(x, pad) for x in padded)
    try:
        out = run(*padded, block_mask=block_mask(layout, query.device), scale=scaling,
                  enable_gqa=query.shape[1] != key.shape[1])
    except torch._dynamo.exc.TorchDynamoException as error:  # torch 2.11 on an H200 failed one fresh compile
        _COMPILED["flex"] = None
        log.warning("packed attention: torch.compile could not build flex_attention here (%s: %s); this process "
                    "runs the packed forward as one attention call per prompt and per completion instead "
                    "(the same values, more calls). Set train.packing: false to pad instead.",
                    type(error).__name__, str(error).splitlines()[0][:300])
        layout.tally.count -= 1
        return segment_attention(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    return out[..., :head_dim].transpose(1, 2).contiguous(), None


def _flex_runner(device: torch.device) -> Any:
    """``flex_attention`` compiled once per process on CUDA (``None`` once the compiler failed
    there), eager elsewhere."""
    from torch.nn.attention.flex_attention import flex_attention

    if device.type != "cuda":
        return flex_attention
    if "flex" not in _COMPILED:
        _COMPILED["flex"] = torch.compile(flex_attention, dynamic=True)
    return _COMPILED["flex"]


def _register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(PACKED_ATTENTION, segment_attention)
    AttentionInterface.register(FLEX_ATTENTION, flex_segment_attention)


def _attention_configs(decoder: nn.Module) -> list[Any]:
    """The distinct configs whose ``_attn_implementation`` the decoder's modules read."""
    configs: dict[int, Any] = {}
    for module in decoder.modules():
        config = getattr(module, "config", None)
        if config is not None and hasattr(config, "_attn_implementation"):
            configs.setdefault(id(config), config)
    return list(configs.values())


@contextlib.contextmanager
def attention_switched(decoder: nn.Module, name: str = PACKED_ATTENTION) -> Iterator[None]:
    """Inside, every attention layer of ``decoder`` runs the registered attention ``name``; so
    does a checkpointed layer's recomputation in the backward of a forward run inside."""
    _register()
    with _switched(_attention_configs(decoder), name):
        yield


@contextlib.contextmanager
def _switched(configs: list[Any], name: str) -> Iterator[None]:
    saved = [(config, config._attn_implementation_internal) for config in configs]
    for config, _ in saved:
        config._attn_implementation_internal = name
    try:
        with on_recompute(functools.partial(_switched, configs, name)):  # the configs found once, not per layer
            yield
    finally:
        for config, previous in saved:
            config._attn_implementation_internal = previous


def packed_decoder_call(decoder: nn.Module, layout: PackedRows) -> Tensor:
    """The decoder's last hidden states ``(N, H)`` on the packed sequence ``layout``.

    RuntimeError when not every layer attended through the packed attention (a layer that
    mixes positions another way, a recurrent or linear-attention one, would mix rows)."""
    layout.tally.count = 0
    with attention_switched(decoder, FLEX_ATTENTION if layout.attention == "flex" else PACKED_ATTENTION):
        out = decoder(input_ids=layout.input_ids, position_ids=layout.position_ids, use_cache=False,
                      **{LAYOUT_KWARG: layout})
    layers = getattr(decoder.config, "num_hidden_layers", None)
    if layers is not None and layout.attention_calls != layers:
        raise RuntimeError(
            f"packed forward: {layout.attention_calls} of the {layers} layers of {type(decoder).__name__} ran the "
            "packed attention; the others would mix the packed rows: set train.packing: false"
        )
    return out.last_hidden_state[0]


def packing_unsupported(model: Any, decoder: nn.Module) -> str | None:
    """Why the packed forward cannot run ``model`` exactly in this call, or None when it can."""
    if decoder.training and torch.is_grad_enabled() and checkpointed_otherwise(decoder):
        return ("a layer is checkpointed by a function that recomputes it with the model's own attention, after "
                "the packed call (enable checkpointing through model.gradient_checkpointing)")
    return _structural_reason(model)


def _structural_reason(model: Any) -> str | None:
    """Why the model's attention cannot be packed exactly whatever the call, or None."""
    if getattr(model.config, "vision_config", None) is not None:
        return ("the model takes images (packing runs text-only models: an image-text-to-text model's own "
                "forward places the image features and, for Qwen2-VL, the 3-D positions)")
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    kinds = sorted({str(kind) for kind in getattr(config, "layer_types", None) or ()} - {"full_attention"})
    if kinds:
        return f"the model has layers of kind {', '.join(kinds)} (packing runs full-attention layers only)"
    if getattr(config, "sliding_window", None) is not None and getattr(config, "use_sliding_window", True):
        return "the model uses sliding-window attention"
    for name in ("attn_logit_softcapping", "attention_chunk_size"):
        if getattr(config, name, None):
            return f"the model's attention sets {name}"
    return None


def resolve_packing(setting: bool | str, model: Any, device: torch.device | None = None) -> bool:
    """``train.packing`` for ``model``: False stays False; True needs a model packing can run
    exactly (RunError naming the reason otherwise); ``"auto"`` packs where it was measured to
    win (:data:`AUTO_DEVICES`) and the model allows it. ``device``: where the forwards compute
    (the process's device; weights offloaded to the CPU still compute on the GPU); default
    the decoder's weights' device."""
    if setting is False:
        return False
    decoder = model.get_decoder()
    reason = _structural_reason(model)
    if setting is True:
        if reason is not None:
            raise RunError(f"train.packing: true cannot run this model exactly: {reason}; "
                           "set train.packing: auto or false")
        return True
    if device is None:
        device = next(decoder.parameters()).device
    return reason is None and device.type in AUTO_DEVICES
