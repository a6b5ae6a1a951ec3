"""``sample`` and ``compute_logprobs`` for tinker-serve: the ``hf`` rollout backend
(:class:`grpo_plugins.rollout.hf.HFRollout`) generates from a sampling session's weights (a
sampler snapshot loaded as an adapter of its own, or the base model with adapters off), then
one forward pass scores the sampled tokens (log-probs at the sampling temperature); or, with
``--rollout vllm`` or ``vllm-server``, that engine generates with the snapshot pushed to it as
an adapter and gives the log-probs (:mod:`~grpo_plugins.tinker.engines`). Prompt log-probs
(``prompt_logprobs``, NaN at position 0, as Tinker's) are one forward pass of the served model.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch
from grpo_plugins.rollout.hf import HFRollout, HFRolloutOptions
from grpo_plugins.tinker.state import SAMPLER_ADAPTERS, Refused, Service

from grpo_core.contracts import RolloutSetup, SamplingParams

__all__ = ["parse", "sample"]

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
    """The context to sample in: the snapshot at ``path`` as the active adapter, or the base model.

    A snapshot is loaded from its file as an adapter of its own the first time, and the last
    :data:`~grpo_plugins.tinker.state.SAMPLER_ADAPTERS` used stay loaded; the least recently
    used goes first (loaded again from its file if asked for again): an RL loop saves a
    snapshot every step, and each would otherwise stay in memory for the server's life."""
    peft = service._peft()
    if path is None:
        return peft.disable_adapter() if peft is not None else contextlib.nullcontext()
    loaded = service._sampler_adapters
    if path in loaded:
        loaded.move_to_end(path)
    else:
        saved = torch.load(service._file(path)[2], weights_only=False)
        while len(loaded) >= SAMPLER_ADAPTERS:
            service.model.delete_adapter(loaded.popitem(last=False)[1])
        adapter = f"sampler-{next(service._ids)}"
        service._add_adapter(adapter, saved["lora"])
        service._load_adapter(adapter, saved["adapter"], path)
        loaded[path] = adapter
    service._use(loaded[path])
    return contextlib.nullcontext()


def _params(params: dict[str, Any]) -> tuple[SamplingParams, list[int] | None]:
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


def _score(service: Service, sequences: list[list[int]], temperature: float) -> list[torch.Tensor]:
    """For each sequence, the log-probs of its tokens after the first given what precedes
    them, at ``temperature``: one right-padded forward pass for all."""
    width = max(len(s) for s in sequences)
    ids = torch.zeros((len(sequences), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, seq in enumerate(sequences):
        ids[row, :len(seq)], mask[row, :len(seq)] = torch.tensor(seq), 1
    with torch.no_grad():
        logits = service.model(input_ids=ids, attention_mask=mask).logits.float()[:, :-1] / max(temperature, 1e-6)
    logp = torch.log_softmax(logits, -1).gather(2, ids[:, 1:, None])[..., 0]
    return [logp[row, :len(seq) - 1] for row, seq in enumerate(sequences)]


@dataclass
class _Request:
    """One parsed sample request: the weights, the prompt, the settings."""

    path: str | None
    prompt: list[int]
    n: int
    sampling: SamplingParams
    stop_ids: list[int] | None
    prompt_logprobs: bool

    @property
    def key(self) -> tuple:
        """Requests with the same key are generated in one call."""
        return self.path, self.n, self.sampling, None if self.stop_ids is None else tuple(self.stop_ids)


def parse(service: Service, body: dict[str, Any]) -> _Request:
    """A ``/api/v1/asample`` body, checked: :class:`Refused` names what is not served."""
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
    if not prompt:
        raise Refused("sample: the prompt is empty")
    sampling, stop_ids = _params(body["sampling_params"])
    n, logprobs = int(body.get("num_samples", 1)), bool(body.get("prompt_logprobs"))
    return _Request(path, prompt, n, sampling, stop_ids, logprobs)


Answer = tuple[list[tuple[list[int], list[float], str]], list[float] | None]


def sample(service: Service, requests: list[_Request]) -> list[Answer]:
    """Answer sample requests that share a key (:attr:`_Request.key`) with one ``generate``
    call: for each, its sequences (tokens, log-probs, stop reason) and its prompt log-probs
    when asked. With the ``hf`` backend one scoring pass gives the sampled tokens' log-probs;
    an engine (``service.engine``, :mod:`~grpo_plugins.tinker.engines`) gives its own."""
    first = requests[0]
    prompts = [r.prompt for r in requests]
    engine = service.engine
    if engine is not None:
        engine.select(first.path, lambda: _weights(service, first.path))
        batch = engine.generate(prompts, first.n, first.sampling, first.stop_ids)
    wanted = [r for r in requests if r.prompt_logprobs]
    # the served model's weights: for hf's generation and scoring, and for prompt log-probs
    with _weights(service, first.path) if engine is None or wanted else contextlib.nullcontext():
        if engine is None:
            backend = _backend(service)
            eos = backend.eos_ids
            if first.stop_ids is not None:
                backend.eos_ids = first.stop_ids
            try:
                batch = backend.generate(prompts, first.n, first.sampling)
            finally:
                backend.eos_ids = eos
        rows = []
        for row in range(len(requests) * first.n):
            kept = batch.completion_mask[row]
            tokens = batch.completion_ids[row][kept].tolist()
            logps = batch.sampling_logp[row][kept].tolist() if engine is not None else None
            rows.append((requests[row // first.n].prompt, tokens, logps,
                         "length" if bool(batch.truncated[row]) else "stop"))
        if engine is None:
            scored = _score(service, [p + t for p, t, _, _ in rows], first.sampling.temperature)
            rows = [(p, t, scored[j][len(p) - 1:].tolist(), f) for j, (p, t, _, f) in enumerate(rows)]
        scored_prompts = iter(_score(service, [r.prompt for r in wanted], 1.0)) if wanted else iter(())
        answers = []
        for i, request in enumerate(requests):
            sequences = [(t, lp, f) for _, t, lp, f in rows[i * first.n:(i + 1) * first.n]]
            answers.append((sequences, [float("nan")] + next(scored_prompts).tolist()
                            if request.prompt_logprobs else None))
    return answers
