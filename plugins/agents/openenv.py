"""An OpenEnv environment (``openenv-core``) run unchanged as an agent.

OpenEnv's environments follow a Gymnasium-style protocol: ``reset()`` gives the first
observation, ``step(action)`` the next one, each an ``Observation`` (pydantic) with ``done``,
``reward`` and the environment's own fields. An in-process ``Environment`` returns the
observation itself; a client of an environment server (``EnvClient``, synchronous) returns a
``StepResult`` holding it with its ``reward`` and ``done``. Both are read here.

:func:`openenv_agent` makes an agent (``grpo_core.Trainer(agent=...)``) whose episode is one
environment episode as a chat: the row's prompt, then each observation as a user message; the
policy's answer, through the endpoint, becomes the action; the episode ends when the
environment says ``done`` (or after ``max_turns`` actions). The rewards of the steps, summed,
are the episode's reward (``env_reward``; None when the environment gave none).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from grpo_core.http import HTTPClient

#: Observation fields that are the protocol's, not what the environment shows.
PROTOCOL_FIELDS = {"done", "reward", "metadata"}


def observation_text(observation: Any) -> str:
    """What the policy reads of ``observation``: its one text field, or its own fields as
    JSON (``done``, ``reward`` and ``metadata`` left out)."""
    fields = {k: v for k, v in observation.model_dump().items() if k not in PROTOCOL_FIELDS}
    if len(fields) == 1 and isinstance(next(iter(fields.values())), str):
        return next(iter(fields.values()))
    return json.dumps(fields, default=str)


def text_action(action_class: Any) -> Callable[[str], Any]:
    """The action of a class with one required text field, filled with the policy's answer."""
    required = [name for name, f in action_class.model_fields.items() if f.is_required()]
    if len(required) != 1:
        raise ValueError(f"{action_class.__name__} has {len(required)} required fields ({', '.join(required)}); "
                         "pass action=a function from the policy's text to an action")
    return lambda text: action_class(**{required[0]: text})


def _unpack(result: Any) -> tuple[Any, float | None, bool]:
    """(observation, reward, done) of a reset or step result: an Observation, or a StepResult."""
    observation = getattr(result, "observation", result)
    reward = getattr(result, "reward", None)
    return observation, None if reward is None else float(reward), bool(getattr(result, "done", False))


def openenv_agent(make_environment: Callable[[], Any], action: Any, *, text: Callable[[Any], str] = observation_text,
                  max_turns: int = 8) -> Callable[[Any], float | None]:
    """An agent running one episode of ``make_environment()`` per grpo-core episode.

    ``action``: the environment's Action class with one required text field, or a function
    from the policy's text to an action. ``text``: what the policy reads of an observation.
    """
    to_action = action if not isinstance(action, type) else text_action(action)

    def agent(episode: Any) -> float | None:
        environment = make_environment()
        client = HTTPClient(timeout_s=episode.timeout, max_bytes=64 << 20)
        headers = {"Authorization": f"Bearer {episode.api_key}"}
        prompt = episode.row["prompt"]
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else [dict(m) for m in prompt]
        rewards: list[float] = []
        try:
            observation, reward, done = _unpack(environment.reset())
            for _ in range(max_turns):
                shown = text(observation)
                if shown:
                    messages.append({"role": "user", "content": shown})
                if done:
                    break
                body = {"model": episode.model, "messages": messages}
                answer = client.request("POST", f"{episode.base_url}/chat/completions", json=body,
                                        headers=headers).json()["choices"][0]["message"]
                messages.append({"role": "assistant", "content": answer.get("content") or ""})
                observation, reward, done = _unpack(environment.step(to_action(answer.get("content") or "")))
                reward = reward if reward is not None else getattr(observation, "reward", None)
                if reward is not None:
                    rewards.append(float(reward))
                done = done or bool(getattr(observation, "done", False))
                if done:
                    break
        finally:
            close = getattr(environment, "close", None)
            if callable(close):
                close()
        return sum(rewards) if rewards else None

    agent.__name__ = "openenv_agent"
    return agent
