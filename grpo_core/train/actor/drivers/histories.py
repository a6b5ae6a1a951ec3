"""Agent histories that are not append-only (``rollout.agent.history``).

An agent episode is one token sequence while each request's prompt extends it: the messages
sent before, each assistant message as the endpoint answered it, and the chat template
rendering the new messages after them without rendering the earlier turns again. A request
that breaks this (an edited or compacted history, a sub-agent's own conversation, a chat
template that renders a past assistant turn otherwise once messages follow it: Qwen3's drops
past ``<think>`` blocks) either fails the episode (``refuse``) or starts a new training sample
of it (``split``): the request is prompted as the chat template renders its messages, and the
sample holds that prompt and the tokens sampled under it. This is prime-rl's "best-effort
interleaving" (merge while the extension property holds, a new sample where it breaks) and
TRL's AsyncGRPO forking of a rewritten conversation.

:class:`Sample` is one training sample while its episode runs; :func:`episode_row` lays an
episode's samples out as one row of a rollout (the layout of
:attr:`grpo_core.contracts.Episodes.splits`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from grpo_core.endpoint.server import EndpointError, plain, same_message, tool_calls


class NotExtended(Exception):
    """A request that does not extend its episode: ``error`` is what ``refuse`` answers."""

    def __init__(self, error: EndpointError):
        super().__init__(error.message)
        self.error = error


@dataclass
class Sample:
    """A finished training sample of an episode: its prompt's token ids and, after it, the
    tokens recorded under it (the policy's under ``mask``, with the sampler's log-probs)."""

    prompt: list[int]
    ids: list[int] = field(default_factory=list)
    mask: list[bool] = field(default_factory=list)
    logp: list[float] = field(default_factory=list)


def template_message(message: dict[str, Any]) -> dict[str, Any]:
    """What the chat template renders of a message when a whole conversation is rendered again:
    its role and text, and an assistant message's tool calls (arguments as an object, as
    transformers' templates take them) and ``reasoning_content``."""
    out = plain(message)
    calls = [{"type": "function", "function": {"name": name, "arguments": arguments}}
             for name, arguments in tool_calls(message)]
    if calls:
        out["tool_calls"] = calls
    if isinstance(message.get("reasoning_content"), str):
        out["reasoning_content"] = message["reasoning_content"]
    return out


def keeps_turn(tokenizer: Any, text: str, new: list[dict[str, Any]], kwargs: dict[str, Any]) -> bool:
    """Whether the chat template renders an assistant turn of ``text`` the same once the
    messages ``new`` follow it (False for a template that drops past thinking, as Qwen3's
    does once a user message follows, or that fails on them)."""
    probe = [{"role": "user", "content": "x"}, {"role": "assistant", "content": text}]
    try:
        base = tokenizer.apply_chat_template(probe, tokenize=False, **kwargs)
        full = tokenizer.apply_chat_template(probe + [plain(m) for m in new], tokenize=False,
                                             add_generation_prompt=True, **kwargs)
    except Exception:  # noqa: BLE001 - a template that cannot render them: not an extension either
        return False
    return full.startswith(base)


def called_names(history: list[tuple[dict[str, Any], bool]], new: list[dict[str, Any]]) -> list[str]:
    """The function name each tool message of ``new`` answers, in order: the call whose id its
    ``tool_call_id`` names, else the last assistant message's calls in turn (as gpt-oss's
    template infers it); ``"tool"`` when there is none."""
    by_id: dict[str, str] = {}
    last: list[str] = []
    for message, _ in history:
        calls = [c for c in message.get("tool_calls") or [] if isinstance(c, dict)]
        if message.get("role") == "assistant" and calls:
            last = [str((c.get("function") or {}).get("name")) for c in calls]
            by_id.update({str(c.get("id")): name for c, name in zip(calls, last)})
    names, order = [], iter(last)
    for message in new:
        if message.get("role") == "tool":
            names.append(by_id.get(str(message.get("tool_call_id"))) or next(order, "tool"))
    return names


def first_difference(tokenizer: Any, fresh: list[int], recorded: list[int]) -> str | None:
    """Where a fresh rendering's token ids first differ from an episode's recorded ones, as the
    texts that follow there (None when they are equal)."""
    if fresh == recorded:
        return None
    at = next((i for i, (a, b) in enumerate(zip(fresh, recorded)) if a != b), min(len(fresh), len(recorded)))
    rendered, sampled = (tokenizer.decode(ids[at:at + 24]) for ids in (fresh, recorded))
    return f"at token {at} the template renders {rendered!r}, the episode holds {sampled!r}"


def shared_messages(messages: list[dict[str, Any]], history: list[tuple[dict[str, Any], bool]]) -> int:
    """How many leading ``messages`` are the episode's ``history`` (an answered assistant
    message compared as :func:`~grpo_core.endpoint.server.same_message` does)."""
    for i, (sent, (had, answered)) in enumerate(zip(messages, history)):
        if not (same_message(sent, had) if answered else plain(sent) == plain(had)):
            return i
    return min(len(messages), len(history))


def episode_row(samples: list[Sample], common: int) -> tuple[list[int], list[bool], list[float], list[int]]:
    """One row of a rollout from an episode's ``samples`` after the group's prompt (its first
    ``common`` tokens, which every sample's prompt starts with): ``(ids, mask, logp, splits)``,
    each sample's prompt after those tokens as context then its tokens, ``splits`` the
    positions where the second, third... sample start."""
    ids: list[int] = []
    mask: list[bool] = []
    logp: list[float] = []
    splits: list[int] = []
    for k, sample in enumerate(samples):
        if k:
            splits.append(len(ids))
        rest = sample.prompt[common:]
        ids += rest + sample.ids
        mask += [False] * len(rest) + sample.mask
        logp += [0.0] * len(rest) + sample.logp
    return ids, mask, logp, splits
