"""What every multi-turn driver shares: an episode's record while it runs
(:class:`EpisodeRecord`), the chat template rendering observations as tokens
(:class:`TurnRenderer`), tools shown in a prompt (:func:`with_tools`), the batch of a
rollout's episodes (:func:`episodes_batch`) and their ``env/`` metrics (:func:`episode_metrics`).

Tool prompts: when the tokenizer's chat template renders ``tools`` (Qwen, Llama 3,
Hermes-style templates) the environment's JSON schemas are passed to it. When it ignores
them (SmolLM2's ChatML template, for one) a system message in this module's plain-text
convention (:data:`TOOL_PROMPT`) lists the schemas and the call format
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``; an existing system message
gets it appended.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

import torch

from grpo_core.contracts import DriverSetup, Episodes, RolloutBatch, left_pad
from grpo_core.errors import RunError

TOOL_PROMPT = (
    "You can call these tools:\n<tools>\n{schemas}\n</tools>\n"
    "To call a tool, write <tool_call>{{\"name\": \"<tool name>\", \"arguments\": {{<JSON arguments>}}}}</tool_call> "
    "and stop; the result comes back in a tool message. When you know the answer, reply without a tool call."
)
_SENTINEL = "\x00GRPO-TURN\x00"


def _render(tokenizer, messages: list[dict], **kwargs) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)


def template_renders_tools(tokenizer, tools: list[dict]) -> bool:
    """Whether the chat template shows ``tools`` to the model (its rendering changes)."""
    probe = [{"role": "user", "content": "x"}]
    return _render(tokenizer, probe, tools=tools, add_generation_prompt=True) != _render(
        tokenizer, probe, add_generation_prompt=True)


def with_tools(tokenizer, messages: list[dict], tools: list[dict]) -> tuple[list[dict], dict[str, Any]]:
    """``(messages, template kwargs)`` that show ``tools`` to the model: ``tools=`` for a
    template that renders them, else the :data:`TOOL_PROMPT` system message."""
    if not tools:
        return messages, {}
    if template_renders_tools(tokenizer, tools):
        return messages, {"tools": tools}
    text = TOOL_PROMPT.format(schemas="\n".join(json.dumps(t) for t in tools))
    if messages and messages[0].get("role") == "system":
        return [{**messages[0], "content": f"{messages[0]['content']}\n\n{text}"}, *messages[1:]], {}
    return [{"role": "system", "content": text}, *messages], {}


class TurnRenderer:
    """Token ids of an observation, rendered by the chat template as it would render the
    conversation: the end of the model's turn the model did not write itself, then the
    observation's messages, then the header of the next assistant turn."""

    def __init__(self, tokenizer, eos_ids: list[int]):
        if not getattr(tokenizer, "chat_template", None):
            raise RunError("rollout.environment needs a tokenizer with a chat template (the tokenizer has none)")
        self.tokenizer = tokenizer
        self.probe = [{"role": "user", "content": "x"}, {"role": "assistant", "content": _SENTINEL}]
        self.base = _render(tokenizer, self.probe)
        at = self.base.rfind(_SENTINEL)
        if at < 0:
            raise RunError("rollout.environment: the chat template drops assistant messages; cannot render turns")
        self.tail = self.base[at + len(_SENTINEL):]  # what closes an assistant turn, e.g. "<|im_end|>\n"
        self.eos_texts = [tokenizer.decode([i]) for i in eos_ids]

    def observation_ids(self, messages: list[dict], ended_with_eos: bool) -> list[int]:
        try:
            full = _render(self.tokenizer, self.probe + messages, add_generation_prompt=True)
        except Exception as exc:
            roles = sorted({str(m.get("role")) for m in messages})
            raise RunError(
                f"rollout.environment: the chat template cannot render messages with role(s) {roles}: "
                f"{type(exc).__name__}: {exc} (the tools environment takes role: user)") from exc
        if not full.startswith(self.base):
            raise RunError("rollout.environment: the chat template re-renders earlier turns when a message is "
                           "added, so observations cannot be appended as tokens")
        closing = self.tail
        if ended_with_eos:  # the model wrote the turn's end token itself
            closing = next((closing[len(e):] for e in self.eos_texts if e and closing.startswith(e)), closing)
        return self.tokenizer(closing + full[len(self.base):], add_special_tokens=False)["input_ids"]


@dataclass
class EpisodeRecord:
    """One episode as it runs: its tokens after the prompt (the model's under ``mask``), the
    sampler's log-probs of them, the conversation after the prompt, its counts."""

    prompt_ids: list[int]
    state: Any
    ids: list[int] = field(default_factory=list)
    mask: list[bool] = field(default_factory=list)
    logp: list[float] = field(default_factory=list)
    messages: list[dict] = field(default_factory=list)
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    reward: float | None = None
    done: bool = False
    truncated: bool = False
    last_eos: bool = False  # the last model turn ended with an EOS token
    splits: list[int] = field(default_factory=list)  # where its 2nd, 3rd... training sample start in ids
    queue_wait: float | None = None  # an agent episode's: seconds its requests waited for the policy's answers
    agent_seconds: float | None = None  # an agent episode's: seconds of its agent's own (what timeout_s bounds)

    def extend(self, ids: list[int], trained: bool, logp: list[float] | None = None) -> None:
        self.ids += ids
        self.mask += [trained] * len(ids)
        self.logp += logp if logp is not None else [0.0] * len(ids)


def episodes_batch(prompts: list[list[int]], episodes: list[EpisodeRecord], tokenizer: Any, pad_id: int,
                   device: torch.device, with_logp: bool, failed: list[bool] | None = None) -> RolloutBatch:
    """The :class:`RolloutBatch` of ``B = P*G`` episodes (prompt-major) after the ``P``
    prompts' token ids: each episode's tokens are its completion, the model's under the mask,
    the rest context; ``failed`` marks episodes an agent failed."""
    width = max(1, max(len(e.ids) for e in episodes))
    rows = len(episodes)
    ids = torch.full((rows, width), pad_id, dtype=torch.long)
    mask = torch.zeros((rows, width), dtype=torch.bool)
    logp = torch.zeros((rows, width), dtype=torch.float32) if with_logp else None
    for i, e in enumerate(episodes):
        ids[i, : len(e.ids)] = torch.tensor(e.ids, dtype=torch.long)
        mask[i, : len(e.ids)] = torch.tensor(e.mask, dtype=torch.bool)
        if logp is not None:
            logp[i, : len(e.ids)] = torch.tensor(e.logp, dtype=torch.float32)
    prompt_ids, prompt_mask = left_pad(prompts, pad_id)
    record = Episodes(
        messages=[e.messages for e in episodes], env_rewards=[e.reward for e in episodes],
        turns=torch.tensor([e.turns for e in episodes]), tool_calls=torch.tensor([e.tool_calls for e in episodes]),
        tool_errors=torch.tensor([e.tool_errors for e in episodes]),
        lengths=torch.tensor([len(e.ids) for e in episodes]),
        failed=torch.tensor(failed if failed is not None else [False] * rows, dtype=torch.bool),
        splits=[list(e.splits) for e in episodes] if any(e.splits for e in episodes) else None,
        queue_wait=_seconds([e.queue_wait for e in episodes]),
        agent_seconds=_seconds([e.agent_seconds for e in episodes]),
    )
    return RolloutBatch(
        prompt_ids.to(device), prompt_mask.to(device), ids.to(device), mask.to(device),
        torch.tensor([e.truncated for e in episodes], device=device),
        tokenizer.batch_decode([e.ids for e in episodes], skip_special_tokens=False),
        None if logp is None else logp.to(device), episodes=record,
    )


def _seconds(values: list[float | None]) -> torch.Tensor | None:
    """``float (B,)`` of per-episode durations, NaN where an episode has none; None if none has."""
    if all(v is None for v in values):
        return None
    return torch.tensor([math.nan if v is None else v for v in values], dtype=torch.float64)


def device_of(backend: Any) -> torch.device:
    """Where the backend's rollouts live: its capabilities' ``device`` (None is the CPU)."""
    device = backend.capabilities.device
    return torch.device(device) if device is not None else torch.device("cpu")


def episode_metrics(episodes: Episodes, mask: torch.Tensor, prefix: str = "") -> dict[str, float]:
    """Per-episode means: ``env/turns_per_episode``, ``env/tool_calls``, ``env/tool_errors``,
    ``env/model_tokens``, ``env/env_tokens``, ``env/samples_per_episode`` (training samples:
    more than 1 where an agent's history was split); ``env/tool_call_rate`` (episodes with at
    least one call) and ``env/tool_success_rate`` (calls without error, over all calls); for
    agent episodes, ``env/queue_wait_seconds`` (the time an episode's requests waited at the
    endpoint for the policy's answers) and ``env/agent_seconds`` (the rest of its time, its
    agent's own: what ``rollout.agent.timeout_s`` bounds)."""
    model_tokens = mask.sum(dim=1).float().cpu()
    calls, errors = episodes.tool_calls.float(), episodes.tool_errors.float()
    out = {
        "env/turns_per_episode": float(episodes.turns.float().mean()),
        "env/tool_calls": float(calls.mean()),
        "env/tool_errors": float(errors.mean()),
        "env/model_tokens": float(model_tokens.mean()),
        "env/env_tokens": float((episodes.lengths.float() - model_tokens).mean()),
        "env/tool_call_rate": float((calls > 0).float().mean()),
        "env/samples_per_episode": float(episodes.samples.float().mean()),
    }
    if calls.sum() > 0:
        out["env/tool_success_rate"] = float(1 - errors.sum() / calls.sum())
    if episodes.failed is not None:
        out["env/failed_episodes"] = float(episodes.failed.float().mean())
    for name, seconds in (("queue_wait_seconds", episodes.queue_wait), ("agent_seconds", episodes.agent_seconds)):
        if seconds is not None and not seconds.isnan().all():
            out[f"env/{name}"] = float(seconds.nanmean())
    return {f"{prefix}{k}": v for k, v in out.items()}


def source_of(run: DriverSetup, kind: str, driver: str) -> Any:
    """The spec slot of ``kind`` (``environment``, ``agent``) that ``driver`` runs; a
    :class:`RunError` naming the setting when the run gives it another or none."""
    source = run.source
    if getattr(source, "kind", None) != kind:
        raise RunError(f"episode driver '{driver}' runs rollout.{kind} (or a route's {kind}); set it, or choose "
                       "another driver (rollout.driver.name)")
    return source
