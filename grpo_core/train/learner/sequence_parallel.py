"""Sequence parallelism in the learner: each sequence split over ``N`` processes (Ulysses).

With ``train.parallel.sequence: N`` the processes form groups of ``N`` consecutive ranks.
A forward of the group runs one sequence (a packed micro-batch, or padded rows) with each
process holding ``1/N`` of its tokens: embeddings, norms, MLPs and the output layer see only
the process's own slice, so the activations a backward keeps fall by about ``N``. Attention
is the one place where positions meet; there every process trades its slice of all heads
for all positions of ``H/N`` heads (an all-to-all: scatter heads, gather the sequence),
computes the whole sequence's attention on those heads, and trades back (Jacobs et al.
2023, DeepSpeed-Ulysses, https://arxiv.org/abs/2309.14509). Queries, keys and values reach
the all-to-all after the rotary embedding, computed from the global position ids, so the
result is the unsplit model's up to float rounding.

Rows stay with the process that collected them, as in data parallelism: its loss, its
normalizers and its metrics are its own. A group's forward gathers the rows its members
pass (:func:`split_logprobs`), computes each token's log-prob on the process holding the
hidden state that predicts it, and sums the per-token results over the group, so each
member gets its rows' log-probs back, with gradients flowing to whichever process computed
them (the backward of the all-to-all is the all-to-all back; of the sum, the sum of the
members' gradients). The members take turns (:meth:`SplitSequences.interleave`): the group
runs member 0's micro-batches, then member 1's, ...; a member whose turn it is not joins with
no rows. Every parameter's gradient is then the sum of every process's part, which the
data-parallel strategy below (DDP or FSDP2, over all processes) sums as it does without
sequence parallelism: the step equals one process's.

Which models: text-only causal LMs whose every layer is full attention through
transformers' attention interface (Llama, Qwen2/2.5/3, Mistral without a sliding window,
...), the models :func:`grpo_core.train.learner.packing.packing_unsupported` accepts, with
attention heads and key/value heads both divisible by ``N``. The attention runs as
:func:`~grpo_core.train.learner.packing.segment_attention` (or its ``flex_attention`` form on
a GPU) for packed rows, and as one causal ``scaled_dot_product_attention`` per left-padding
width for padded rows, whatever ``model.attn_implementation`` says.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from grpo_core.errors import RunError
from grpo_core.train.learner.head_logprobs import DEFAULT_CHUNK_SIZE, logit_transform, token_logprobs
from grpo_core.train.learner.packing import (
    LAYOUT_KWARG,
    attention_switched,
    flex_segment_attention,
    needed_lengths,
    pack_rows,
    packing_unsupported,
    segment_attention,
)

__all__ = ["SEQUENCE_ATTENTION", "SequenceGroup", "SplitSequences", "split_logprobs", "check_model",
           "scatter_heads", "gather_heads"]

#: The name the sequence-parallel attention is registered under with transformers.
SEQUENCE_ATTENTION = "grpo_sequence_parallel"

#: The keyword argument that carries a call's :class:`_Split` down to every attention layer.
SPLIT_KWARG = "grpo_sequence_split"

_SPECIAL = ("softcap", "sinks", "s_aux", "position_bias", "sliding_window")


# ----------------------------------------------------------------------------- the group
@dataclass
class SequenceGroup:
    """The ``size`` processes that split each sequence, this process being ``index`` of them,
    and their torch process group."""

    size: int
    index: int
    group: Any = None

    @classmethod
    def of(cls, rank: int, world: int, size: int, timeout_s: float = 1800.0) -> SequenceGroup:
        """Groups of ``size`` consecutive ranks; every process makes every group (torch's rule
        for ``new_group``) and keeps its own. RunError when ``size`` does not divide ``world``."""
        import torch.distributed as dist

        if size < 1 or world % size:
            raise RunError(f"train.parallel.sequence = {size} must divide the {world} processes of the run "
                           "(each sequence is split over that many processes; groups of consecutive ranks)")
        mine = None
        for first in range(0, world, size):
            ranks = list(range(first, first + size))
            group = dist.new_group(ranks, timeout=datetime.timedelta(seconds=timeout_s))
            if rank in ranks:
                mine = group
        return cls(size, rank % size, mine)

    def gather(self, obj: Any) -> list[Any]:
        """``obj`` of every member, in rank order (pickled; small objects)."""
        import torch.distributed as dist

        out: list[Any] = [None] * self.size
        dist.all_gather_object(out, obj, group=self.group)
        return out


class _AllToAll(torch.autograd.Function):
    """Equal blocks of dim 0 exchanged over the group: block ``j`` goes to member ``j``. Its own
    backward: the gradient's blocks go back where they came from."""

    @staticmethod
    def forward(ctx, x: Tensor, group: Any) -> Tensor:
        import torch.distributed as dist

        ctx.group = group
        x = x.contiguous()
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        return _AllToAll.apply(grad.contiguous(), ctx.group), None


class _GroupSum(torch.autograd.Function):
    """The sum over the group's members; backward: the sum of the members' gradients (each
    member's output feeds its own loss)."""

    @staticmethod
    def forward(ctx, x: Tensor, group: Any) -> Tensor:
        import torch.distributed as dist

        ctx.group = group
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        return _GroupSum.apply(grad.contiguous(), ctx.group), None


def scatter_heads(x: Tensor, group: SequenceGroup) -> Tensor:
    """``(b, h, s, d)``: all heads of this member's ``s`` positions, to ``(b, h/N, N*s, d)``: its
    ``h/N`` heads (the ``index``-th block) at every position of the sequence."""
    b, h, s, d = x.shape
    n = group.size
    blocks = x.reshape(b, n, h // n, s, d).transpose(0, 1)  # (n, b, h/n, s, d): block j for member j
    got = _AllToAll.apply(blocks, group.group)  # block j: member j's positions of our heads
    return got.permute(1, 2, 0, 3, 4).reshape(b, h // n, n * s, d)


def gather_heads(x: Tensor, group: SequenceGroup) -> Tensor:
    """The inverse of :func:`scatter_heads`: ``(b, h/N, N*s, d)`` to ``(b, h, s, d)``."""
    b, hn, length, d = x.shape
    n = group.size
    blocks = x.reshape(b, hn, n, length // n, d).permute(2, 0, 1, 3, 4)  # block j: member j's positions
    got = _AllToAll.apply(blocks, group.group)  # block j: member j's heads at our positions
    return got.transpose(0, 1).reshape(b, n * hn, length // n, d)


# ----------------------------------------------------------------------------- attention
class _Split:
    """What one split decoder call's attention layers read (a plain object, not a dataclass:
    FSDP2's mixed precision copies the dataclasses of keyword arguments)."""

    def __init__(self, group: SequenceGroup, inner: Callable, **inner_kwargs: Any):
        self.group, self.inner, self.inner_kwargs = group, inner, inner_kwargs
        self.calls = 0


def sequence_attention(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Any,
                       dropout: float = 0.0, scaling: float | None = None, **kwargs: Any) -> tuple[Tensor, None]:
    """Attention over the whole sequence of which this process holds a slice: ``query
    (b, heads, s, d)``, ``key``/``value (b, kv_heads, s, d)`` in, ``(b, s, heads, d)`` out, as
    transformers' attention functions; the call's :class:`_Split` in ``kwargs``."""
    split = kwargs.pop(SPLIT_KWARG, None)
    if split is None:
        raise RuntimeError(f"sequence-parallel attention: {type(module).__name__} was called without its split "
                           "(its model does not pass keyword arguments down to attention)")
    special = [k for k in _SPECIAL if kwargs.get(k) is not None]
    if special or attention_mask is not None:
        raise RuntimeError(f"sequence-parallel attention: {type(module).__name__} asked for {special or 'a mask'}, "
                           "which the split attention cannot honour")
    split.calls += 1
    q, k, v = (scatter_heads(t, split.group) for t in (query, key, value))
    out, _ = split.inner(module, q, k, v, None, dropout=dropout, scaling=scaling, **{**kwargs, **split.inner_kwargs})
    return gather_heads(out.transpose(1, 2), split.group).transpose(1, 2).contiguous(), None


def rows_attention(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Any,
                   dropout: float = 0.0, scaling: float | None = None, *, starts: list[int],
                   **kwargs: Any) -> tuple[Tensor, None]:
    """Padded rows' attention: row ``b``'s tokens from column ``starts[b]`` on (its left padding
    before) attend causally to each other; one causal ``sdpa`` call per distinct start. The
    outputs at left-padding columns are 0 (never read). ``(b, s, heads, d)`` out."""
    heads, kv_heads = query.shape[1], key.shape[1]
    if heads != kv_heads:
        key = key.repeat_interleave(heads // kv_heads, dim=1)
        value = value.repeat_interleave(heads // kv_heads, dim=1)
    out = torch.zeros_like(query)
    where = torch.tensor(starts, device=query.device)
    for start in sorted(set(starts)):
        rows = (where == start).nonzero().squeeze(1)
        part = F.scaled_dot_product_attention(query[rows, :, start:], key[rows, :, start:], value[rows, :, start:],
                                              dropout_p=dropout, is_causal=True, scale=scaling)
        out = out.index_put((rows,), F.pad(part, (0, 0, start, 0)))
    return out.transpose(1, 2).contiguous(), None


def _register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(SEQUENCE_ATTENTION, sequence_attention)


# ----------------------------------------------------------------------------- the log-prob function
@dataclass
class _Part:
    """One member's rows for a split forward (on the CPU, to be gathered): its prompts
    ``(p, L)``, the rows that have a token to compute ``(r, T)``, their prompts, the call's options."""

    prompt_ids: Tensor
    prompt_mask: Tensor
    completion_ids: Tensor
    mask: Tensor
    prompt_index: Tensor
    packed: bool
    with_entropy: bool
    temperature: float


def _own_part(prompt_ids, prompt_mask, completion_ids, mask, prompt_index, packed, with_entropy, temperature):
    """``(part, rows)``: this member's :class:`_Part` (rows with a token, trimmed) and their indices."""
    need = needed_lengths(mask)
    rows = (need > 0).nonzero().squeeze(1)
    prompts, index = torch.unique(prompt_index[rows.cpu()], return_inverse=True)
    width = int(need.max()) if len(rows) else 0
    p_mask = prompt_mask[prompts.to(prompt_mask.device)]
    keep = p_mask.any(0).nonzero()
    first = int(keep[0]) if keep.numel() else p_mask.shape[1]
    part = _Part(prompt_ids[prompts.to(prompt_ids.device)][:, first:].cpu(), p_mask[:, first:].cpu(),
                 completion_ids[rows, :width].cpu(), mask[rows, :width].cpu(), index.cpu(), packed, with_entropy,
                 float(temperature))
    return part, rows


def _joined(parts: list[_Part], device: torch.device) -> tuple[Tensor, ...]:
    """The members' rows as one batch: prompts left-padded, completions right-padded to the
    widest; ``(prompt_ids, prompt_mask, completion_ids, mask, prompt_index)`` on ``device``."""
    length = max(p.prompt_ids.shape[1] for p in parts)
    width = max(p.completion_ids.shape[1] for p in parts)
    ids, masks, comps, cmasks, index, offset = [], [], [], [], [], 0
    for p in parts:
        left = length - p.prompt_ids.shape[1]
        ids.append(F.pad(p.prompt_ids, (left, 0)))
        masks.append(F.pad(p.prompt_mask, (left, 0)))
        comps.append(F.pad(p.completion_ids, (0, width - p.completion_ids.shape[1])))
        cmasks.append(F.pad(p.mask, (0, width - p.mask.shape[1])))
        index.append(p.prompt_index + offset)
        offset += p.prompt_ids.shape[0]
    return tuple(torch.cat(t).to(device) for t in (ids, masks, comps, cmasks, index))


def _agreed(parts: list[_Part]) -> tuple[bool, bool, float]:
    """``(packed, with_entropy, temperature)`` of the group's call; RunError where members differ."""
    packed = {p.packed for p in parts}
    temperatures = {p.temperature for p in parts if p.mask.any()}
    if len(packed) > 1 or len(temperatures) > 1:
        raise RunError(f"sequence parallelism: the members of a group called the model with other settings "
                       f"(packed {sorted(packed)}, temperatures {sorted(temperatures)})")
    return packed.pop(), any(p.with_entropy for p in parts), temperatures.pop() if temperatures else 1.0


def _packed_sequence(joined: tuple[Tensor, ...], n: int):
    """``(ids (S,), positions (S,), where (K,), split)`` of the packed layout of the joined rows,
    padded to a multiple of ``n`` by a segment of its own; ``where``: the position whose hidden
    state predicts each masked token (the mask's row-major order)."""
    p_ids, p_mask, c_ids, c_mask, index = joined
    layout = pack_rows(p_ids, p_mask, c_ids, c_mask, index)
    pad = -layout.tokens % n
    if pad:
        device = layout.input_ids.device
        layout.segments.append((pad, ()))
        layout.input_ids = torch.cat([layout.input_ids, layout.input_ids.new_zeros((1, pad))], dim=1)
        layout.position_ids = torch.cat([layout.position_ids, torch.arange(pad, device=device)[None]], dim=1)
    inner = flex_segment_attention if layout.attention == "flex" else segment_attention
    return layout.input_ids[0], layout.position_ids[0], layout.hidden_index[c_mask], (inner, {LAYOUT_KWARG: layout})


def _padded_rows(joined: tuple[Tensor, ...], n: int):
    """``(ids (R, S), positions (R, S), where (K,), split)`` of the joined rows padded: each row
    its prompt (left-padded) then its completion, ``S`` padded on the right to a multiple of
    ``n``; ``where`` indexes the flattened ``(R * S)`` positions."""
    p_ids, p_mask, c_ids, c_mask, index = joined
    length = p_ids.shape[1]
    ids = torch.cat([p_ids[index], c_ids], dim=1)
    valid = torch.cat([p_mask[index], torch.ones_like(c_mask)], dim=1)
    pad = -ids.shape[1] % n
    ids, valid = F.pad(ids, (0, pad)), F.pad(valid, (0, pad))
    positions = (valid.long().cumsum(-1) - 1).clamp(min=0)
    starts = (length - p_mask[index].sum(1)).tolist()
    steps = torch.arange(c_ids.shape[1], device=ids.device)
    where = (torch.arange(ids.shape[0], device=ids.device)[:, None] * ids.shape[1] + length - 1 + steps)[c_mask]
    return ids, positions, where, (partial(rows_attention, starts=starts), {})


def split_logprobs(
    model: Any, prompt_ids: Tensor, prompt_mask: Tensor, completion_ids: Tensor, completion_mask: Tensor, *,
    sequence: SequenceGroup, chunk_size: int = DEFAULT_CHUNK_SIZE, with_entropy: bool = False,
    temperature: float = 1.0, share_prompt: bool = True, length_buckets: bool = True, packed: bool = False,
    prompt_index: Tensor | None = None, images: list | None = None,
) -> tuple[Tensor, Tensor | None]:
    """:func:`~grpo_core.train.learner.logprobs.completion_logprobs`'s result for this member's rows,
    computed by the whole ``sequence`` group on the rows of all its members (a collective:
    every member calls it together, those with nothing to compute with rows whose mask is
    empty). The joined rows run packed (``packed``) or padded as one sequence split ``N`` ways;
    ``share_prompt`` and ``length_buckets`` do not apply (a prompt is encoded once per row
    padded, once per prompt packed). Returns ``(logp, entropy)`` ``(B, T)`` as that function does."""
    if images is not None:
        raise RunError("train.parallel.sequence: prompts with images cannot be split over processes yet; "
                       "set train.parallel.sequence: 1")
    rows_total, prompts = completion_ids.shape[0], prompt_ids.shape[0]
    if prompt_index is None:
        prompt_index = torch.arange(prompts).repeat_interleave(rows_total // max(prompts, 1))
    mask = completion_mask.bool()
    part, rows = _own_part(prompt_ids, prompt_mask.bool(), completion_ids, mask, prompt_index.cpu(), packed,
                           with_entropy, temperature)
    parts = sequence.gather(part)
    packed, with_entropy, temperature = _agreed(parts)
    head, device = model.get_output_embeddings(), completion_ids.device
    dtype = torch.promote_types(head.weight.dtype, torch.float32)
    out = torch.zeros(completion_ids.shape, dtype=dtype, device=device)
    entropy = torch.zeros_like(out) if with_entropy else None
    live = [p for p in parts if len(p.mask)]
    if live:
        joined = _joined(live, device)
        ids, positions, where, (inner, extra) = (_packed_sequence if packed else _padded_rows)(joined, sequence.size)
        targets = joined[2][joined[3]]
    else:  # no member has a token: the model still runs (a collective under FSDP2), its result times 0
        ids, positions = (torch.zeros((1, sequence.size), dtype=torch.long, device=device) for _ in range(2))
        where, targets, inner, extra = ids.new_zeros(0), ids.new_zeros(0), partial(rows_attention, starts=[0]), {}
        joined = None
    hidden, mine, local = _split_decoder_call(model, ids, positions, where, sequence, inner, extra)
    flat, flat_entropy = token_logprobs(hidden[local], head, targets[mine], chunk_size=chunk_size,
                                        with_entropy=with_entropy, temperature=temperature,
                                        **logit_transform(model.config))
    if not bool(mine.any()):  # the output layer joins the graph all the same (DDP's gradient hooks)
        flat = flat + 0.0 * token_logprobs(hidden[:1], head, targets.new_zeros(1))[0].sum()
    if joined is None:
        return out + 0.0 * flat.sum(), entropy
    # one sum over the group for both: its backward, a collective, runs whichever output the caller uses
    values = torch.stack([flat, flat_entropy]) if with_entropy else flat[None]
    offset = sum(len(p.mask) for p in parts[: sequence.index])
    own = _own_rows(values, mine, joined[3], sequence, offset, rows, out)
    return own[0], (own[1] if with_entropy else None)


def _split_decoder_call(model, ids, positions, where, sequence, inner, extra):
    """Run the decoder on this member's slice of the sequence ``ids`` (``(S,)`` packed or
    ``(R, S)`` padded); return ``(hidden (R * s, H), mine, local)``: its hidden states, which of
    the target positions ``where`` it holds and their rows in ``hidden``."""
    two_d = ids.dim() == 2
    ids2, pos2 = (ids, positions) if two_d else (ids[None], positions[None])
    rows, length = ids2.shape
    share = length // sequence.size
    start = sequence.index * share
    decoder = model.get_decoder()
    split = _Split(sequence, inner, **extra)
    _register()
    with attention_switched(decoder, SEQUENCE_ATTENTION):
        out = decoder(input_ids=ids2[:, start:start + share], position_ids=pos2[:, start:start + share],
                      use_cache=False, **{SPLIT_KWARG: split})
    layers = getattr(decoder.config, "num_hidden_layers", None)
    if layers is not None and split.calls != layers:
        raise RuntimeError(f"sequence-parallel forward: {split.calls} of the {layers} layers of "
                           f"{type(decoder).__name__} ran the split attention; the others would see a slice only")
    hidden = out.last_hidden_state.reshape(rows * share, -1)
    row, column = where // length, where % length
    mine = (column >= start) & (column < start + share)
    local = row[mine] * share + column[mine] - start
    return hidden, mine, local


def _own_rows(values: Tensor, mine: Tensor, joined_mask: Tensor, sequence: SequenceGroup, offset: int, rows: Tensor,
              out: Tensor) -> Tensor:
    """This member's rows of the group's per-token values: ``values (k, m)`` (``k`` kinds of the
    ``m`` tokens this process computed) placed among all masked tokens of the joined rows,
    summed over the group, then its own rows (``offset`` the first of them among the joined,
    ``rows`` their indices in ``out``) written into a copy of ``out (B, T)`` each: ``(k, B, T)``."""
    kinds = values.shape[0]
    where = mine[None].expand(kinds, -1)
    every = torch.zeros(where.shape, dtype=out.dtype, device=out.device).masked_scatter(where, values.to(out.dtype))
    every = _GroupSum.apply(every, sequence.group)
    full = joined_mask[None].expand(kinds, -1, -1)
    table = torch.zeros(full.shape, dtype=out.dtype, device=out.device).masked_scatter(full, every)
    own = table[:, offset: offset + len(rows)]
    width = min(own.shape[2], out.shape[1])
    return out[None].expand(kinds, -1, -1).index_copy(1, rows.to(out.device),
                                                      F.pad(own[:, :, :width], (0, out.shape[1] - width)))


# ----------------------------------------------------------------------------- checks and the strategy
def check_model(model: Any, size: int) -> None:
    """RunError unless ``model`` can be split ``size`` ways exactly: full attention through the
    attention interface (the models packing runs), no activation checkpointing, and attention
    heads and key/value heads divisible by ``size``."""
    plain = getattr(model, "module", model)
    reason = packing_unsupported(plain, plain.get_decoder())
    if reason is None and any(getattr(m, "gradient_checkpointing", False) for m in plain.modules()):
        reason = "activation checkpointing recomputes attention outside the split call (model.gradient_checkpointing)"
    if reason is not None:
        raise RunError(f"train.parallel.sequence = {size} cannot split this model: {reason}")
    config = plain.config.get_text_config() if hasattr(plain.config, "get_text_config") else plain.config
    heads = getattr(config, "num_attention_heads", None)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    if heads is None or heads % size or kv_heads % size:
        raise RunError(f"train.parallel.sequence = {size} must divide the model's attention heads "
                       f"(num_attention_heads = {heads}) and key/value heads (num_key_value_heads = {kv_heads}): "
                       "each process computes attention on heads / sequence of them")


class SplitSequences:
    """What sequence parallelism changes in a data-parallel strategy (a mixin over
    :class:`~grpo_core.train.learner.parallel.DDP` or ``FSDP2``): the log-prob function
    (:func:`split_logprobs` over the process's :class:`SequenceGroup`) and the order of the
    passes (:meth:`interleave`: the members' micro-batches in turn)."""

    sequence: SequenceGroup

    def __init__(self, dist: Any, parallel: Any):
        super().__init__(dist, parallel)
        self.sequence = SequenceGroup.of(dist.rank, dist.world, parallel.sequence, dist.timeout_s)
        self.logprobs = partial(split_logprobs, sequence=self.sequence)

    def setup(self, model: nn.Module, reference: nn.Module | None = None) -> None:
        check_model(model, self.sequence.size)
        super().setup(model, reference)

    def lockstep(self, passes: int, shareable: bool, idle: Callable[[int, bool], None]) -> bool:
        """No passes first: :meth:`interleave` places every pass of the group."""
        return True

    def no_grad_passes(self, passes: int) -> int:
        return 0

    def interleave(self, items: list) -> list:
        """This process's ``items`` (micro-batches) at their turn among its group's: after the
        earlier members' and before the later ones', None for each pass of another member's;
        then None up to the longest group's count (at least one pass: every process joins the
        gradient sum and, under FSDP2, each collective)."""
        counts, size = self.gather(len(items)), self.sequence.size
        first = self.dist.rank - self.sequence.index
        ours = counts[first:first + size]
        longest = max(1, max(sum(counts[g:g + size]) for g in range(0, len(counts), size)))
        before, after = sum(ours[: self.sequence.index]), sum(ours[self.sequence.index + 1:])
        return [None] * before + list(items) + [None] * (after + longest - sum(ours))
