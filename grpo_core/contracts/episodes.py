"""The multi-turn contracts: what an environment answers to a model turn, an agent program
that talks to the policy through an OpenAI-compatible endpoint, and the episodes of a rollout
(the driver that runs them: :mod:`~grpo_core.contracts.drivers`)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor


# --------------------------------------------------------------------------- environments
@dataclass
class Observation:
    """What an environment answers to one model turn.

    Attributes:
        messages: chat messages appended to the conversation (``{"role": "tool",
            "content": ...}`` for a tool result, ``{"role": "user", ...}`` for a user
            turn); rendered with the model's chat template and fed back as context.
        done: the episode is over (no further model turn).
        reward: the environment's own reward for the episode, or ``None``; the last one
            an episode returns reaches reward functions as the ``env_reward`` column.
        tool_calls: tool calls the turn made (for the ``env/`` metrics).
        tool_errors: of those, calls that failed (malformed, unknown tool, raised, timed out).
    """

    messages: list[dict[str, Any]] = field(default_factory=list)
    done: bool = False
    reward: float | None = None
    tool_calls: int = 0
    tool_errors: int = 0


@runtime_checkable
class Environment(Protocol):
    """A multi-turn episode source: tools, a simulated user, a game.

    ``tools``: JSON schemas of the functions the model may call (transformers' format,
    ``{"type": "function", "function": {...}}``), given to the chat template with the
    prompt; empty for an environment without tools. ``stop``: strings that end a model
    turn besides EOS (``"</tool_call>"`` for tools). ``reset(row)`` opens an episode for
    a dataset row and returns its state (anything); ``step(state, text)`` takes the text of
    one model turn and returns the next :class:`Observation`. ``step`` runs in the
    trainer's process and must not raise for the model's mistakes: they are observations.
    """

    tools: list[dict[str, Any]]
    stop: tuple[str, ...]

    def reset(self, row: dict[str, Any]) -> Any: ...

    def step(self, state: Any, text: str) -> Observation: ...


@dataclass(frozen=True)
class AgentEpisode:
    """What an agent gets for one episode.

    Attributes:
        base_url: an OpenAI-compatible endpoint (``/chat/completions``, ``/completions``,
            ``/models``) that the run serves on 127.0.0.1 for the duration of the rollout,
            backed by the run's rollout backend; pass it to any client
            (``openai.AsyncOpenAI(base_url=..., api_key=...)``).
        api_key: this episode's key: every request must carry it (``Authorization: Bearer``);
            it ties the requests to the episode whose tokens they extend.
        model: the model name to put in requests (any name is accepted).
        row: the dataset row (every column), as reward functions see it.
        index: which of the ``G`` episodes of its prompt this is (0-based).
        timeout: seconds of its own the episode may take (``rollout.agent.timeout_s``); after
            them it is cancelled and recorded as failed. The time its requests wait for the
            policy's answers does not count, and under load one request may wait far longer
            than ``timeout`` (up to ``rollout.agent.wait_timeout_s``): a client's own request
            timeout should not be set from it.
    """

    base_url: str
    api_key: str
    model: str
    row: dict[str, Any]
    index: int
    timeout: float


@runtime_checkable
class Agent(Protocol):
    """A program that runs one episode against the policy: ``agent(episode)`` with an
    :class:`AgentEpisode`, a plain function or an ``async def`` coroutine function, talking to
    ``episode.base_url`` with any OpenAI-compatible client, as many calls as it likes. It
    returns the episode's reward (a float), or None to leave scoring to the reward functions,
    which receive the episode's messages as completions (and its reward as ``env_reward``).

    A request whose prompt extends the episode's history (the messages the agent sent before,
    each followed by the assistant message the endpoint answered) goes on the episode's
    sequence: the trainer keeps the tokens the policy sampled, and never re-tokenizes them. One
    that does not (an edited or compacted history, a sub-agent's conversation, a chat template
    that drops past thinking) starts a new training sample of the same episode
    (``rollout.agent.history: split``, the default) or fails the episode (``refuse``). An agent
    that raises (even ``SystemExit`` or ``KeyboardInterrupt``) or times out is a failed episode
    (no reward), never a crashed run nor another episode's failure. A malformed request gets a
    400 and the episode goes on.
    """

    def __call__(self, episode: AgentEpisode) -> Any: ...


@dataclass
class Episodes:
    """Per-row records of ``B`` multi-turn episodes (attached to their :class:`RolloutBatch`).

    Attributes:
        messages: the conversation after the prompt, per row (assistant turns and the
            environment's messages, in order): what reward functions receive.
        env_rewards: the environment's reward per row, or ``None``.
        turns: ``long (B,)`` model turns.
        tool_calls: ``long (B,)``; tool_errors: ``long (B,)``.
        lengths: ``long (B,)`` episode length in tokens after the prompt (model and
            environment tokens; the model's are ``completion_mask.sum(1)``).
        failed: ``bool (B,)`` episodes an agent failed (raised, timed out, edited its
            history under ``rollout.agent.history: refuse``, broke a limit), or None
            (in-process environments do not fail).
        splits: per row, the positions (into ``T``) where the episode's second, third...
            training sample starts, or None when no episode of the batch was split. An agent
            episode whose history is not append-only (``rollout.agent.history: split``) is
            several samples, each its own prompt and the tokens sampled under it; its row
            holds them one after the other: the first sample's tokens, then for each later one
            its prompt after the group's prompt (context) and its tokens. The learner trains
            each sample as its own sequence (:mod:`grpo_core.train.learner.samples`); rewards
            and advantages stay the episode's.
        queue_wait: ``float64 (B,)`` seconds each agent episode's requests waited at the
            endpoint for the policy's answers (NaN for a row no agent ran), or None.
        agent_seconds: ``float64 (B,)`` seconds of each agent episode that were its agent's
            own (its time less ``queue_wait``: what ``rollout.agent.timeout_s`` bounds), or None.
    """

    messages: list[list[dict[str, Any]]]
    env_rewards: list[float | None]
    turns: Tensor
    tool_calls: Tensor
    tool_errors: Tensor
    lengths: Tensor
    failed: Tensor | None = None
    splits: list[list[int]] | None = None
    queue_wait: Tensor | None = None
    agent_seconds: Tensor | None = None

    def select(self, rows: Sequence[int]) -> Episodes:
        idx = torch.tensor(list(rows), dtype=torch.long)
        return Episodes([self.messages[i] for i in rows], [self.env_rewards[i] for i in rows],
                        self.turns[idx], self.tool_calls[idx], self.tool_errors[idx], self.lengths[idx],
                        None if self.failed is None else self.failed[idx],
                        None if self.splits is None else [list(self.splits[i]) for i in rows],
                        None if self.queue_wait is None else self.queue_wait[idx],
                        None if self.agent_seconds is None else self.agent_seconds[idx])

    @staticmethod
    def concat(parts: Sequence[Episodes]) -> Episodes:
        failed = None if any(p.failed is None for p in parts) else torch.cat([p.failed for p in parts])
        splits = None
        if any(p.splits is not None for p in parts):
            splits = [list(s) for p in parts for s in (p.splits or [[] for _ in p.messages])]
        return Episodes([m for p in parts for m in p.messages], [r for p in parts for r in p.env_rewards],
                        *(torch.cat([getattr(p, k) for p in parts]) for k in ("turns", "tool_calls",
                                                                              "tool_errors", "lengths")), failed,
                        splits, _seconds(parts, "queue_wait"), _seconds(parts, "agent_seconds"))

    @property
    def samples(self) -> Tensor:
        """``long (B,)``: training samples per episode (1 unless its history was split)."""
        if self.splits is None:
            return torch.ones(len(self.messages), dtype=torch.long)
        return torch.tensor([1 + len(s) for s in self.splits], dtype=torch.long)


def _seconds(parts: Sequence[Episodes], name: str) -> Tensor | None:
    """The parts' per-episode durations ``name`` as one, NaN for a part without them (an
    environment's rows beside an agent's), None when no part has them."""
    if all(getattr(p, name) is None for p in parts):
        return None
    return torch.cat([getattr(p, name) if getattr(p, name) is not None
                      else torch.full((len(p.messages),), math.nan, dtype=torch.float64) for p in parts])
