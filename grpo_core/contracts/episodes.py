"""The multi-turn contract: what an environment answers to a model turn, and the episodes
of a rollout."""

from __future__ import annotations

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
    """

    messages: list[list[dict[str, Any]]]
    env_rewards: list[float | None]
    turns: Tensor
    tool_calls: Tensor
    tool_errors: Tensor
    lengths: Tensor

    def select(self, rows: Sequence[int]) -> Episodes:
        idx = torch.tensor(list(rows), dtype=torch.long)
        return Episodes([self.messages[i] for i in rows], [self.env_rewards[i] for i in rows],
                        self.turns[idx], self.tool_calls[idx], self.tool_errors[idx], self.lengths[idx])

    @staticmethod
    def concat(parts: Sequence[Episodes]) -> Episodes:
        return Episodes([m for p in parts for m in p.messages], [r for p in parts for r in p.env_rewards],
                        *(torch.cat([getattr(p, k) for p in parts]) for k in ("turns", "tool_calls",
                                                                              "tool_errors", "lengths")))
