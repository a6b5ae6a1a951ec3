"""The ``hf`` backend's lean decode loop (``rollout: {name: hf, decode: lean}``, the default).

transformers ``generate`` keeps every row of the batch in every decode step until the
last row ends: a row that produced EOS at token 3 of 128 is still run through the model
125 more times (its outputs replaced by padding). With sampled completions of uneven
length, a large share of the decode compute of a group goes to finished rows. This loop
drops a row from the batch (its KV cache rows included) as soon as it ends, and does
nothing else per token than the forward, the sampling and the stop check.

Same tokens as ``generate``: the sampling knobs are applied by transformers' own warpers
(temperature, then top-k, then top-p, as ``generate`` orders them), and a sampled token
is drawn with the rule ``torch.multinomial(probs, 1)`` uses on CPU for one sample,
``argmax(probs / E)`` with ``E ~ Exponential(1)`` of the shape of the *whole* batch's
probabilities, drawn every step for all ``B`` rows as ``generate`` does (finished rows
included) and indexed by the rows still alive. Under a fixed seed the two therefore draw
the same noise for the same row and step, and give the same tokens up to float rounding
of the forward at a different batch size (see ``tests/plugins/test_rollout_decode.py``).

That draw costs ``B * V`` exponentials per step (44 ms for 32 rows of SmolLM2's 49k
vocabulary on one core, against ~2 ms for what follows). ``sampler: inverse-cdf`` draws one
uniform per row instead and inverts the cumulative distribution: the same distribution,
not the same tokens as ``generate``.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import Tensor

from grpo_core.contracts import SamplingParams

__all__ = ["lean_decode", "warpers", "inverse_cdf"]


def warpers(sampling: SamplingParams):
    """transformers' logits warpers for ``sampling``, in ``generate``'s order; None for greedy
    decoding (no warper changes an argmax)."""
    from transformers import (
        LogitsProcessorList,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    if sampling.greedy:
        return None
    out = LogitsProcessorList()
    if sampling.temperature != 1.0:
        out.append(TemperatureLogitsWarper(sampling.temperature))
    if sampling.top_k:
        out.append(TopKLogitsWarper(top_k=sampling.top_k, min_tokens_to_keep=1))
    if sampling.top_p < 1.0:
        out.append(TopPLogitsWarper(top_p=sampling.top_p, min_tokens_to_keep=1))
    return out


def inverse_cdf(probs: Tensor, uniforms: Tensor) -> Tensor:
    """One token per row of ``probs (a, V)`` for ``uniforms (a,)`` in [0, 1): the smallest
    ``k`` with ``cumsum(probs)[k] > u * sum(probs)``. A token of probability 0 is never
    drawn (its cumulative sum equals its predecessor's), and ``u * sum`` is kept below the
    sum so that float rounding cannot step past the last token."""
    cdf = probs.cumsum(dim=-1)
    total = cdf[:, -1:]
    target = torch.minimum(uniforms[:, None].to(cdf.dtype) * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, target, right=True).squeeze(1)


def _pick(
    scores: Tensor, alive: Tensor, batch: int, processors: Any, seqs: Tensor | None, sampler: str
) -> Tensor:
    """Next tokens ``long (a,)`` of the ``a`` alive rows from their float32 logits ``(a, V)``:
    argmax (greedy); ``argmax(softmax(warped) / E)`` with ``E`` drawn for all ``batch`` rows
    (``sampler="multinomial"``, generate's draw); or :func:`inverse_cdf` with one uniform
    drawn for each of the ``batch`` rows (``"inverse-cdf"``: ``V`` times fewer draws)."""
    if processors is None:
        return scores.argmax(dim=-1)
    scores = processors(seqs, scores)
    probs = torch.softmax(scores, dim=-1)
    if sampler == "inverse-cdf":
        uniforms = torch.rand((batch,), device=probs.device)
        return inverse_cdf(probs, uniforms[alive])
    noise = torch.empty((batch, probs.shape[-1]), dtype=probs.dtype, device=probs.device)
    noise.exponential_(1)
    return (probs / noise[alive]).argmax(dim=-1)


def _forward(model: Any, ids: Tensor, mask: Tensor, positions: Tensor, cache: Any, keep_arg: bool) -> Tensor:
    """float32 logits ``(b, V)`` of the last position of ``ids (b, s)`` (the cache extended)."""
    kwargs = {"logits_to_keep": 1} if keep_arg else {}
    out = model(
        input_ids=ids, attention_mask=mask, position_ids=positions,
        past_key_values=cache, use_cache=True, **kwargs,
    )
    return out.logits[:, -1].float()


def lean_decode(
    model: Any,
    ids: Tensor,
    mask: Tensor,
    cache: Any,
    sampling: SamplingParams,
    eos_ids: list[int],
    pad_id: int,
    stop_criterion: Any | None = None,
    sampler: str = "multinomial",
) -> tuple[Tensor, Tensor]:
    """Decode up to ``sampling.max_new_tokens`` tokens for ``B`` left-padded rows.

    Args:
        ids, mask: ``long (B, L)`` / ``bool (B, L)`` the rows' prompts (each prompt already
            repeated ``G`` times).
        cache: a ``DynamicCache`` holding the first ``c`` prompt positions of every row
            (``c = L - 1`` after a shared prefill, ``0`` for an empty cache); the remaining
            ``L - c`` positions are fed in the first step.
        eos_ids, pad_id: a row ends at its first token in ``eos_ids``; ``pad_id`` fills
            the positions after it.
        stop_criterion: transformers' ``StopStringCriteria`` (called on the alive rows'
            prompt + completion ids), or None.
        sampler: ``multinomial`` (generate's draw, the same tokens) or ``inverse-cdf`` (the
            same distribution, other tokens, a much cheaper draw); see :func:`_pick`.

    Returns:
        ``(completions, lengths)``: ``long (B, n)`` tokens (``pad_id`` after a row's end,
        ``n`` the number of steps run) and ``long (B,)`` the length of each row that ended
        (its end token included), -1 for rows still running after ``max_new_tokens``.
    """
    batch = ids.shape[0]
    device = ids.device
    processors = warpers(sampling)
    keep_arg = "logits_to_keep" in inspect.signature(model.forward).parameters
    eos = torch.tensor(eos_ids, dtype=torch.long, device=device)
    out = torch.full((batch, sampling.max_new_tokens), pad_id, dtype=torch.long, device=device)
    lengths = torch.full((batch,), -1, dtype=torch.long, device=device)
    alive = torch.arange(batch, device=device)
    attn = mask.long()
    positions = (attn.cumsum(-1) - 1).masked_fill(attn == 0, 0)
    cached = cache.get_seq_length()
    step_ids, step_pos = ids[:, cached:], positions[:, cached:]
    seqs = ids if stop_criterion is not None else None  # only the stop check reads them
    steps = 0
    for t in range(sampling.max_new_tokens):
        logits = _forward(model, step_ids, attn, step_pos, cache, keep_arg)
        tokens = _pick(logits, alive, batch, processors, seqs, sampler)
        out[alive, t] = tokens
        steps = t + 1
        if seqs is not None:
            seqs = torch.cat([seqs, tokens[:, None]], dim=1)
        done = torch.isin(tokens, eos)
        if stop_criterion is not None:
            done = done | stop_criterion(seqs, None).to(device)
        if bool(done.any()):
            lengths[alive[done]] = t + 1
            keep = (~done).nonzero().squeeze(1)
            if keep.numel() == 0:
                break
            alive, tokens, attn = alive[keep], tokens[keep], attn[keep]
            step_pos = step_pos[keep]
            seqs = seqs[keep] if seqs is not None else None
            cache.batch_select_indices(keep)
        step_ids = tokens[:, None]
        step_pos = step_pos[:, -1:] + 1
        attn = torch.cat([attn, attn.new_ones((attn.shape[0], 1))], dim=1)
    return out[:, :steps], lengths
