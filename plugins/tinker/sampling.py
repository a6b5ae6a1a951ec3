"""``sample`` and ``compute_logprobs`` for tinker-serve: the ``hf`` rollout backend
(:class:`grpo_plugins.rollout.hf.HFRollout`) generates from a sampling session's weights (a
sampler snapshot loaded as an adapter of its own, or the base model with adapters off), then
one forward pass scores the sampled tokens (log-probs at the sampling temperature) and, when
asked, the prompt's (``prompt_logprobs``, NaN at position 0, as Tinker's).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from grpo_plugins.rollout.hf import HFRollout, HFRolloutOptions
from grpo_plugins.tinker.state import Refused, Service

from grpo_core.contracts import RolloutSetup, SamplingParams

__all__ = ["sample"]

#: Sampling parameters and request fields served; anything else set is refused by name.
_SERVED_REQUEST = {"num_samples", "prompt", "sampling_params", "base_model", "model_path", "sampling_session_id",
                   "seq_id", "prompt_logprobs", "type", "topk_prompt_logprobs", "topk_sample_logprobs",
                   "prompt_alt_tokens_k", "record_stability_info"}


def _backend(service: Service) -> HFRollout:
    if service._rollout is None or service._rollout.model is not service.model:
        backend = HFRollout(HFRolloutOptions(dtype=None))
        backend.setup(RolloutSetup(model=service.model, tokenizer=service.tokenizer))
        service._rollout = backend
    return service._rollout


def _weights(service: Service, path: str | None):
    """The context to sample in: the snapshot at ``path`` as the active adapter, or the base model."""
    peft = service._peft()
    if path is None:
        return peft.disable_adapter() if peft is not None else contextlib.nullcontext()
    if path not in service._sampler_adapters:
        saved = torch.load(service._file(path)[2], weights_only=False)
        adapter = f"sampler-{len(service._sampler_adapters)}"
        service._add_adapter(adapter, saved["lora"])
        service._load_adapter(adapter, saved["adapter"], path)
        service._sampler_adapters[path] = adapter
    service._use(service._sampler_adapters[path])
    return contextlib.nullcontext()


def _params(params: dict[str, Any], backend: HFRollout) -> tuple[SamplingParams, list[int] | None]:
    stop = params.get("stop")
    strings: tuple[str, ...] = ()
    ids: list[int] | None = None
    if isinstance(stop, str):
        strings = (stop,)
    elif isinstance(stop, list) and stop:
        if all(isinstance(s, int) for s in stop):
            ids = [int(s) for s in stop]
        elif all(isinstance(s, str) for s in stop):
            strings = tuple(stop)
        else:
            raise Refused("sampling_params.stop mixes token ids and strings; send one kind")
    elif stop == []:
        raise Refused("sampling_params.stop = [] (no stop at all, not even EOS) is not served; set max_tokens")
    if params.get("max_tokens") is None:
        raise Refused("sampling_params.max_tokens is required by tinker-serve")
    top_k = int(params.get("top_k", -1))
    return SamplingParams(max_new_tokens=int(params["max_tokens"]), temperature=float(params.get("temperature", 1.0)),
                          top_p=float(params.get("top_p", 1.0)), top_k=0 if top_k < 0 else top_k, stop=strings,
                          seed=params.get("seed")), ids


def _score(service: Service, tokens: list[int], temperature: float) -> torch.Tensor:
    """Log-probs of ``tokens[1:]`` given what precedes each, at ``temperature``."""
    ids = torch.tensor([tokens])
    with torch.no_grad():
        logits = service.model(input_ids=ids).logits.float()[0, :-1] / max(temperature, 1e-6)
    return torch.log_softmax(logits, -1).gather(1, ids[0, 1:, None])[:, 0]


def sample(service: Service, body: dict[str, Any]) -> tuple[list[tuple[list[int], list[float], str]], list | None]:
    """Serve one ``/api/v1/asample`` request: its sequences (tokens, log-probs, stop reason)
    and its prompt log-probs when asked."""
    unserved = sorted(k for k, v in body.items() if k not in _SERVED_REQUEST and v not in (None, 0, False))
    unserved += [k for k in ("topk_prompt_logprobs", "topk_sample_logprobs", "prompt_alt_tokens_k",
                             "record_stability_info") if body.get(k)]
    if unserved:
        raise Refused(f"sample: {', '.join(unserved)} not served by tinker-serve")
    session = body.get("sampling_session_id")
    if session is not None:
        if session not in service.sampling_sessions:
            raise Refused(f"no sampling session {session!r} on this server")
        path = service.sampling_sessions[session]
    else:
        path = body.get("model_path")
        if path is None and body.get("base_model") != service.name:
            raise Refused(f"base_model {body.get('base_model')!r} is not served; this server serves {service.name!r}")
    prompt: list[int] = []
    for chunk in body["prompt"]["chunks"]:
        if chunk.get("type", "encoded_text") != "encoded_text":
            raise Refused(f"sample: a prompt holds a {chunk.get('type')} chunk; tinker-serve samples from text only")
        prompt.extend(chunk["tokens"])
    backend = _backend(service)
    sampling, stop_ids = _params(body["sampling_params"], backend)
    n = int(body.get("num_samples", 1))
    eos = backend.eos_ids
    with _weights(service, path):
        if stop_ids is not None:
            backend.eos_ids = stop_ids
        try:
            batch = backend.generate([prompt], n, sampling)
        finally:
            backend.eos_ids = eos
        sequences = []
        for row in range(n):
            tokens = batch.completion_ids[row][batch.completion_mask[row]].tolist()
            logp = _score(service, prompt + tokens, sampling.temperature)[len(prompt) - 1:].tolist() if tokens else []
            sequences.append((tokens, logp, "length" if bool(batch.truncated[row]) else "stop"))
        prompt_logp = None
        if body.get("prompt_logprobs"):
            prompt_logp = [float("nan")] + _score(service, prompt, 1.0).tolist()
    return sequences, prompt_logp
