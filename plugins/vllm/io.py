"""What the ``vllm`` and ``vllm-server`` rollout backends send vLLM and make of its answers: the
sampling parameters of one request (:func:`sampling_kwargs`, seeds by :func:`request_seed`), as
the body of a server's ``/v1/completions`` request (:func:`completion_body`), and the
:class:`~grpo_core.contracts.RolloutBatch` of its outputs (:func:`outputs_to_batch`).

Plain Python on vLLM's output attributes: nothing here imports vLLM.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch

from grpo_core.contracts import RolloutBatch, SamplingParams, cut_after_stop, left_pad


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

__all__ = ["completion_body", "outputs_to_batch", "repeat_greedy", "request_seed", "sampling_kwargs"]


# --------------------------------------------------------------------------- sampling
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


def sampling_kwargs(
    sampling: SamplingParams, group_size: int, eos_ids: Sequence[int], seed: int | None
) -> dict[str, Any]:
    """Keyword arguments of ``vllm.SamplingParams`` for one prompt: ``group_size`` samples
    of ``sampling``, stopping at ``eos_ids``, seeded with ``seed`` (already mixed) or not.

    Every knob that could change the distribution is set to neutral explicitly, so neither
    vLLM's defaults nor a model's generation config alter what GRPO samples. Greedy decoding
    asks for one completion (vLLM refuses ``n > 1`` there): :func:`repeat_greedy` copies it
    ``group_size`` times, as every greedy sample is the same.
    """
    greedy = sampling.greedy
    return {
        "n": 1 if greedy else group_size,
        "max_tokens": sampling.max_new_tokens,
        "min_tokens": 0,
        "temperature": 0.0 if greedy else sampling.temperature,
        "top_p": 1.0 if greedy else sampling.top_p,
        "top_k": -1 if greedy or sampling.top_k == 0 else sampling.top_k,  # vLLM: -1 = off
        "min_p": 0.0,
        "repetition_penalty": 1.0,
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        "stop": list(sampling.stop),
        "include_stop_str_in_output": True,
        "stop_token_ids": list(eos_ids),
        "ignore_eos": False,
        "seed": seed,
        "logprobs": 0,  # the sampled token's log-prob only
        "skip_special_tokens": True,
    }


def completion_body(
    prompt: list[int], group_size: int, sampling: SamplingParams, eos_ids: Sequence[int], seed: int | None,
    model: str,
) -> dict[str, Any]:
    """The ``/v1/completions`` request of one prompt: the same sampling parameters as the
    colocated backend's (:func:`sampling_kwargs`), token ids in and
    out, the sampled token's log-prob per position."""
    body = sampling_kwargs(sampling, group_size, eos_ids, seed)
    body.update(model=model, prompt=list(prompt), return_token_ids=True, stream=False)
    return body


# --------------------------------------------------------------------------- outputs
@dataclasses.dataclass
class _Repeated:
    outputs: list[Any]


def repeat_greedy(outputs: Sequence[Any], group_size: int) -> list[Any]:
    """Each of vLLM's one-completion greedy ``outputs`` with its completion repeated
    ``group_size`` times (the shape :func:`outputs_to_batch` expects)."""
    return [_Repeated(outputs=list(output.outputs) * group_size) for output in outputs]


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


def engine_prompts(prompt_ids: Sequence[Sequence[int]], images: Sequence[Any] | None) -> list[dict[str, Any]]:
    """The keyword arguments of vLLM's ``TokensPrompt`` for each prompt: its token ids, or for
    a prompt with images (a :class:`~grpo_core.contracts.PromptImages`) its tokens before the
    image placeholders were expanded and the images as ``multi_modal_data`` (vLLM expands
    the placeholders itself, and would expand already expanded ones again)."""
    out: list[dict[str, Any]] = []
    for index, ids in enumerate(prompt_ids):
        found = None if images is None else images[index]
        if found is None:
            out.append({"prompt_token_ids": list(ids)})
        else:
            out.append({"prompt_token_ids": list(found.text_ids), "multi_modal_data": {"image": list(found.images)}})
    return out


def check_expansion(outputs: Sequence[Any], prompt_ids: Sequence[Sequence[int]]) -> None:
    """Refuse outputs whose prompt (as vLLM expanded its image placeholders) is not the
    prompt the trainer scores (as the model's processor expanded them)."""
    for index, (output, ids) in enumerate(zip(outputs, prompt_ids, strict=True)):
        got = getattr(output, "prompt_token_ids", None)
        if got is not None and list(got) != list(ids):
            raise ValueError(
                f"vllm rollout: vLLM expanded the image placeholders of prompt {index} into other tokens than the "
                f"model's processor did ({len(got)} tokens against {len(ids)}); the trainer would score another "
                "prompt than the one sampled. Use rollout.name: hf for this model")


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
