"""What a rollout engine answers, as plain records every backend shares: one completion
(:class:`Completion`) and one prompt's completions (:class:`Output`), with the attributes vLLM's
own output objects have, so a server's checked JSON (:mod:`grpo_plugins.vllm.client`) or a
partial rollout's stitched segments (:mod:`~grpo_plugins.rollout.partial`) go where an
engine's outputs go; the seed of one request (:func:`request_seed`); and the
:class:`~grpo_core.contracts.RolloutBatch` of an engine's outputs (:func:`outputs_to_batch`).
Plain Python on the output attributes: nothing here imports an engine.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch

from grpo_core.contracts import RolloutBatch, cut_after_stop, left_pad

__all__ = ["Completion", "Output", "outputs_to_batch", "request_seed"]


@dataclasses.dataclass
class Completion:
    """One completion of an answer that is not vLLM's own object (a server's JSON, a stitched
    partial rollout), with the attributes :func:`outputs_to_batch` reads from vLLM's outputs."""

    index: int
    token_ids: list[int]
    finish_reason: str | None
    text: str
    logprobs: list[dict[int, float]] | None


@dataclasses.dataclass
class Output:
    """One prompt's completions, as vLLM's ``RequestOutput`` holds them."""

    outputs: list[Completion]


_MASK62 = (1 << 62) - 1


def request_seed(seed: int) -> int:
    """A well-mixed seed in ``[0, 2**62)`` for one vLLM request, from ``seed``.

    vLLM seeds sample ``k`` of an ``n``-sample request with ``seed + k``; mixing keeps the
    streams of neighbouring prompts (``seed + i``) from overlapping. splitmix64's finalizer.
    """
    z = (seed + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (z ^ (z >> 31)) & _MASK62


def _token_logps(completion: Any, ids: list[int], where: str) -> list[float] | None:
    entries = getattr(completion, "logprobs", None)
    if entries is None:
        return None
    values = []
    for t, token in enumerate(ids):
        entry = entries[t].get(token) if t < len(entries) else None
        if entry is None:
            raise ValueError(f"vllm rollout: {where} has no log-prob for its token {t} (id {token})")
        values.append(float(getattr(entry, "logprob", entry)))
    return values


def outputs_to_batch(
    outputs: Sequence[Any],
    prompt_ids: Sequence[Sequence[int]],
    group_size: int,
    *,
    pad_id: int,
    eos_ids: Sequence[int],
    max_new_tokens: int,
    stop: Sequence[str] = (),
    device: torch.device | str = "cpu",
    decode: Callable[[list[list[int]]], list[str]] | None = None,
) -> RolloutBatch:
    """The :class:`RolloutBatch` of vLLM's ``llm.generate`` outputs, one per prompt.

    Each output has ``.outputs``: ``group_size`` completions with ``.index``, ``.token_ids``,
    ``.finish_reason`` (``"stop"`` / ``"length"``), ``.text`` and ``.logprobs`` (a list of
    ``{token_id: Logprob}`` per token, or None). vLLM ends a completion right on its EOS
    token or the token completing a stop string (both kept), so every returned token is
    masked in. ``truncated`` is ``finish_reason == "length"`` unless the last token is an
    EOS (vLLM reports ``length`` when EOS falls on the ``max_tokens``-th token, where ``hf``
    counts it as stopped). ``sampling_logp`` (``float32 (B, T)``, 0 on padding) is None
    when any completion lacks log-probs. Texts are vLLM's, or ``decode(token id rows)`` when
    given (the backend passes its tokenizer's, as the ``hf`` backend decodes: vLLM's
    incremental detokenizer drops incomplete byte sequences that ``batch_decode`` renders as
    U+FFFD), cut right after the first stop string.
    """
    if len(outputs) != len(prompt_ids):
        raise ValueError(f"vllm rollout: {len(outputs)} outputs for {len(prompt_ids)} prompts")
    eos = {int(e) for e in eos_ids}
    rows: list[list[int]] = []
    logps: list[list[float] | None] = []
    truncated: list[bool] = []
    texts: list[str] = []
    for p, output in enumerate(outputs):
        completions = sorted(output.outputs, key=lambda c: getattr(c, "index", 0))
        if len(completions) != group_size:
            raise ValueError(
                f"vllm rollout: prompt {p} has {len(completions)} completions, expected {group_size}"
            )
        for k, completion in enumerate(completions):
            ids = [int(t) for t in completion.token_ids][:max_new_tokens]
            rows.append(ids)
            logps.append(_token_logps(completion, ids, f"completion {k} of prompt {p}"))
            ended = bool(ids) and ids[-1] in eos
            truncated.append(completion.finish_reason in (None, "length") and not ended)
            texts.append(cut_after_stop(completion.text or "", stop))
    if decode is not None:
        texts = [cut_after_stop(text, stop) for text in decode(rows)]
    width = max((len(r) for r in rows), default=0)
    completion_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    completion_mask = torch.zeros((len(rows), width), dtype=torch.bool)
    sampling_logp = torch.zeros((len(rows), width), dtype=torch.float32)
    for b, ids in enumerate(rows):
        completion_ids[b, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        completion_mask[b, : len(ids)] = True
        if logps[b] is not None:
            sampling_logp[b, : len(ids)] = torch.tensor(logps[b], dtype=torch.float32)
    prompts, prompt_mask = left_pad(prompt_ids, pad_id)
    return RolloutBatch(
        prompt_ids=prompts.to(device),
        prompt_mask=prompt_mask.to(device),
        completion_ids=completion_ids.to(device),
        completion_mask=completion_mask.to(device),
        truncated=torch.tensor(truncated, dtype=torch.bool, device=device),
        completions=texts,
        sampling_logp=None if any(v is None for v in logps) else sampling_logp.to(device),
    )
